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

from flows import local_server

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


def _ladder(state: Path, spec: Path, overrides: list[str], until: str = "full") -> float:
    cmd = [sys.executable, "-m", "flows.cli", "run", str(spec), "--until", until]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=_env(state), capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"traingate run {spec.name} failed: {(p.stdout + p.stderr)[-3000:]}")
    return wall


Plan = dict[str, list[tuple[list[str], Path]]]


def _bare_plan(spec_path: Path, overrides: list[str], root: Path) -> tuple[Plan, Path]:
    """Each stage's commands and working directory, from StageJobs written up front, without tracking; and the
    resolved spec file."""
    from traingate.job.stagejob import derive
    from traingate.launch.command import stage_command
    from traingate.recipes.checks import __file__ as checks_init
    from traingate.settings import Settings
    from traingate.spec import load_spec, write_resolved

    spec = load_spec(spec_path, overrides)
    spec_file = write_resolved(spec, root / "spec.yaml")
    py = sys.executable
    script = spec.recipe.script

    def job_cmd(stage: str, halves: int = 1, name: str | None = None) -> tuple[list[str], Path]:
        # The smoke halves share the run's checkpoint location: the second resumes from the first.
        job = derive(
            spec, stage, run_id=root.name, run_dir=root, settings=Settings.from_env(), stage_dir=root / (name or stage)
        )
        stop_at_step = max(1, job.max_steps // 2) if halves == 2 else None  # as traingate.ladder.stage_run
        job = dataclasses.replace(
            job.launch(time.time()), tracking_uri=None, mlflow_run_id=None, stop_at_step=stop_at_step
        )
        job.write()
        cwd = Path(script.workdir) if script is not None else Path(job.stage_dir)
        return stage_command(job, py), cwd

    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    plan: Plan = {}
    if script is None:
        (root / "unit").mkdir(parents=True, exist_ok=True)
        contract = str(Path(checks_init).with_name("test_recipe_contract.py"))
        plan["unit"] = [([*pytest, f"--rootdir={root / 'unit'}", contract], root / "unit")]
        plan["smoke"] = [job_cmd("smoke", 2, "smoke-a"), job_cmd("smoke")]
    else:
        plan["unit"] = (
            [([*pytest, f"--rootdir={script.workdir}", *script.tests], Path(script.workdir))] if script.tests else []
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
        for cmd, cwd in cmds:
            subprocess.run(
                cmd, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800
            )
        out[stage] = time.perf_counter() - t0
    return out


def main() -> str:
    with tempfile.TemporaryDirectory(prefix="tg-bench-ladder-") as tmp:
        state = Path(tmp) / "state"
        try:
            t0 = time.perf_counter()
            _ladder(state, CASES["demo (digits, built-in recipe)"][0], [], until="unit")  # starts the kept server
            warmup_s = time.perf_counter() - t0
            results: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in CASES}
            loads = []
            for r in range(REPEATS):
                for name, (spec, overrides) in CASES.items():
                    if r % 2 == 0:
                        bare = _bare(state, spec, overrides)
                        lad = _ladder(state, spec, overrides)
                    else:
                        lad = _ladder(state, spec, overrides)
                        bare = _bare(state, spec, overrides)
                    results[name].append((lad, bare))
                    loads.append(os.getloadavg()[0])
        finally:
            local_server.stop(state)
    lines = [
        f"| spec | bare commands (s) | `traingate run`, kept server (s) | ladder / bare (median of {REPEATS} pairs) |",
        "|---|---:|---:|---:|",
    ]
    detail = []
    for name, pairs in results.items():
        bare_s = [sum(b.values()) for _, b in pairs]
        lad_s = [lad for lad, _ in pairs]
        ratio = statistics.median(lad / b for lad, b in zip(lad_s, bare_s, strict=True))
        lines.append(f"| {name} | {statistics.median(bare_s):.1f} | {statistics.median(lad_s):.1f} | {ratio:.2f}x |")
        per_stage = ", ".join(f"{s} {statistics.median(b[s] for _, b in pairs):.1f}" for s in pairs[0][1])
        detail.append(
            f"- {name}: ladder {', '.join(f'{x:.1f}' for x in lad_s)} s; bare "
            f"{', '.join(f'{x:.1f}' for x in bare_s)} s (bare per stage, medians: {per_stage} s)"
        )
    lines += [
        "",
        f"First `traingate run --until unit` (kept server's cold start, stores created): {warmup_s:.1f} s. "
        f"Load average {min(loads):.1f}-{max(loads):.1f}.",
        "",
        *detail,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
