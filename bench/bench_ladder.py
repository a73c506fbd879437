"""Platform overhead: `traingate run` up the whole ladder vs. the same training run by bare commands, same invocation.

Three specs: the demo (examples/digits.yaml, a built-in recipe) and the two bundled script recipes, unmodified
third-party-style scripts (examples/script.yaml: a torch classifier with its own pytest tests;
examples/script_project2/spec.yaml: a dependency-free trainer that keeps its own checkpoints).

Ladder: `traingate run SPEC` (CLI start to exit: spec check, preflight, the ladder flow, MLflow on SQLite, gates,
reports) on the local Prefect server traingate keeps, started and warmed once before the clock. Bare: the same
commands the ladder runs, started directly in sequence with no Prefect, no MLflow, no gates: the unit stage's
pytest run (the recipe contract for a built-in recipe, the script's own tests), then each training stage's
command (the demo's smoke as its two halves, a stop at a checkpoint and a resume, as the ladder runs it), each
from a StageJob written up front. The two alternate (bare first in even rounds, the ladder first in odd ones).

A script is handed what the ladder hands it in both columns: the ladder gives a script's stage process the stage's
MLflow run (``MLFLOW_TRACKING_URI``, ``MLFLOW_RUN_ID``), and a script may log there itself (the bundled classifier
does: MLflow's import and its writes are the script's own work), so each bare stage gets an MLflow run of its own in
a SQLite store, created before the clock starts.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flows import cli_engine, cli_forward, local_server

ROOT = Path(__file__).resolve().parents[1]
CASES: dict[str, tuple[Path, list[str]]] = {
    "demo (digits, built-in recipe)": (ROOT / "examples" / "digits.yaml", []),
    "script: torch classifier + its tests": (ROOT / "examples" / "script.yaml", []),
    "script: dependency-free trainer, own checkpoints": (
        ROOT / "examples" / "script_project2" / "spec.yaml",
        [f"data.uri={(ROOT / 'examples' / 'script_project2' / 'data.csv').as_uri()}"],
    ),
}
REPEATS = 2


def _env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "TRAINGATE_", "MLFLOW_")) and k != "CI"}
    env.update(
        TRAINGATE_STATE_DIR=str(state),
        PREFECT_HOME=str(state / "prefect"),
        TRAINGATE_PREFECT_SERVER="kept",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    return env


def _ladder(state: Path, spec: Path, overrides: list[str], until: str = "full", engine: bool = True) -> float:
    cmd = [sys.executable, "-m", "flows.cli", "run", str(spec), "--until", until]
    for o in overrides:
        cmd += ["--set", o]
    env = {**_env(state), **({} if engine else {cli_forward.ENGINE_VAR: "off"})}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"traingate run {spec.name} failed: {(p.stdout + p.stderr)[-3000:]}")
    return wall


Plan = dict[str, list[tuple[list[str], Path, dict[str, str]]]]


def _bare_plan(spec_path: Path, overrides: list[str], root: Path) -> tuple[Plan, Path]:
    """Each stage's commands and working directory, from StageJobs written up front, without tracking; and the
    resolved spec file."""
    from mlflow.tracking import MlflowClient

    from traingate.job.stagejob import derive
    from traingate.launch.command import stage_command
    from traingate.recipes.checks import __file__ as checks_init
    from traingate.settings import Settings
    from traingate.spec import load_spec, write_resolved

    spec = load_spec(spec_path, overrides)
    spec_file = write_resolved(spec, root / "spec.yaml")
    py = sys.executable
    script = spec.recipe.script
    store = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(store) if script is not None else None

    def job_cmd(stage: str, halves: int = 1, name: str | None = None) -> tuple[list[str], Path, dict[str, str]]:
        # The smoke halves share the run's checkpoint location: the second resumes from the first.
        job = derive(
            spec, stage, run_id=root.name, run_dir=root, settings=Settings.from_env(), stage_dir=root / (name or stage)
        )
        stop_at_step = max(1, job.max_steps // 2) if halves == 2 else None  # as traingate.ladder.stage_run
        job = dataclasses.replace(
            job.launch(time.time()), tracking_uri=None, mlflow_run_id=None, stop_at_step=stop_at_step
        )
        job.write()
        if client is None:
            return stage_command(job, py), Path(job.stage_dir), {}
        assert script is not None
        experiment = client.get_experiment_by_name("bare") or client.get_experiment(client.create_experiment("bare"))
        run = client.create_run(experiment.experiment_id, run_name=stage)
        mlflow_env = {"MLFLOW_TRACKING_URI": store, "MLFLOW_RUN_ID": run.info.run_id}
        return stage_command(job, py), Path(script.workdir), mlflow_env

    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    plan: Plan = {}
    if script is None:
        (root / "unit").mkdir(parents=True, exist_ok=True)
        contract = str(Path(checks_init).with_name("test_recipe_contract.py"))
        plan["unit"] = [([*pytest, f"--rootdir={root / 'unit'}", contract], root / "unit", {})]
        plan["smoke"] = [job_cmd("smoke", 2, "smoke-a"), job_cmd("smoke")]
    else:
        plan["unit"] = (
            [([*pytest, f"--rootdir={script.workdir}", *script.tests], Path(script.workdir), {})]
            if script.tests
            else []
        )
        plan["smoke"] = [job_cmd("smoke")]
    plan["canary"] = [job_cmd("canary")]
    plan["full"] = [job_cmd("full")]
    return plan, spec_file


def _bare(state: Path, spec: Path, overrides: list[str]) -> dict[str, float]:
    root = state / "bare" / str(time.monotonic_ns())
    plan, spec_file = _bare_plan(spec, overrides, root)
    # What the ladder's processes get too: the resolved spec for the contract tests, one thread per process
    # (a script recipe's stage sets OMP_NUM_THREADS=1 when the environment leaves it unset).
    env = {**_env(state), "TRAINGATE_SPEC": str(spec_file), "OMP_NUM_THREADS": "1"}
    out: dict[str, float] = {}
    for stage, cmds in plan.items():
        t0 = time.perf_counter()
        for cmd, cwd, extra in cmds:
            subprocess.run(
                cmd,
                env={**env, **extra},
                cwd=cwd,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=1800,
            )
        out[stage] = time.perf_counter() - t0
    return out


def _ratio(ladder: list[float], bare: list[float]) -> float:
    return statistics.median(lad / b for lad, b in zip(ladder, bare, strict=True))


def _list(values: list[float]) -> str:
    return ", ".join(f"{x:.1f}" for x in values)


def _engine_ready(state: Path, timeout_s: float = 300.0) -> None:
    d = local_server.server_dir(state)
    deadline = time.monotonic() + timeout_s
    while not ((record := cli_forward.read_record(d)) and f"ready on {record['socket']}" in (d / cli_engine.LOG).read_text()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the CLI engine was not ready in {timeout_s:.0f} s: {d / cli_engine.LOG}")
        time.sleep(0.2)


def main() -> str:
    with tempfile.TemporaryDirectory(prefix="tg-bench-ladder-") as tmp:
        state = Path(tmp) / "state"
        try:
            t0 = time.perf_counter()
            # Starts the kept server and, as it ends, the CLI engine beside it; both warm before the clock.
            _ladder(state, CASES["demo (digits, built-in recipe)"][0], [], until="unit")
            _engine_ready(state)
            warmup_s = time.perf_counter() - t0
            results: dict[str, list[tuple[float, float, dict[str, float]]]] = {name: [] for name in CASES}
            loads = []
            for r in range(REPEATS):
                for name, (spec, overrides) in CASES.items():
                    if r % 2 == 0:
                        bare = _bare(state, spec, overrides)
                        forked = _ladder(state, spec, overrides)
                        cold = _ladder(state, spec, overrides, engine=False)
                    else:
                        cold = _ladder(state, spec, overrides, engine=False)
                        forked = _ladder(state, spec, overrides)
                        bare = _bare(state, spec, overrides)
                    results[name].append((forked, cold, bare))
                    loads.append(os.getloadavg()[0])
        finally:
            cli_engine.stop(state)
            local_server.stop(state)
    lines = [
        "| spec | bare commands (s) | `traingate run`, forked from the CLI engine (s) | ladder / bare | "
        "`traingate run`, cold (s) | cold ladder / bare |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    detail = []
    for name, runs in results.items():
        bare_s = [sum(b.values()) for _, _, b in runs]
        forked_s = [f for f, _, _ in runs]
        cold_s = [c for _, c, _ in runs]
        lines.append(
            f"| {name} | {statistics.median(bare_s):.1f} | {statistics.median(forked_s):.1f} | "
            f"{_ratio(forked_s, bare_s):.2f}x | {statistics.median(cold_s):.1f} | {_ratio(cold_s, bare_s):.2f}x |"
        )
        per_stage = ", ".join(f"{s} {statistics.median(b[s] for _, _, b in runs):.1f}" for s in runs[0][2])
        detail.append(
            f"- {name}: forked {_list(forked_s)} s; cold {_list(cold_s)} s; bare {_list(bare_s)} s "
            f"(bare per stage, medians: {per_stage} s)"
        )
    lines += [
        "",
        f"Ratios: the median of the rounds' ratios ({REPEATS} rounds). First `traingate run --until unit` (the kept "
        f"server's cold start, stores created, the CLI engine started): {warmup_s:.1f} s. "
        f"Load average {min(loads):.1f}-{max(loads):.1f}.",
        "",
        *detail,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
