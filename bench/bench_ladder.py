"""Platform overhead: the ladder vs. the same steps run by bare commands, same invocation.

Bare baseline: the same pytest run, the same two smoke processes, the same torchrun canary
and full runs, started directly with no Prefect, no MLflow, no gates. Ladder: the `ladder`
flow on a running (temporary) Prefect server with MLflow on SQLite. Per-stage orchestration
overhead = the stage's wall time in the flow (open run .. report published) - the bare stage.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "digits.yaml"
REPEATS = 2


def _bare(state: Path) -> dict[str, float]:
    """The same commands the ladder runs, each from a StageJob written once up front, without tracking."""
    import dataclasses

    from traingate.job.stagejob import derive
    from traingate.launch.command import stage_command
    from traingate.recipes.checks import __file__ as checks_init
    from traingate.settings import Settings
    from traingate.spec import load_spec, write_resolved

    spec = load_spec(SPEC)
    root = state / "bare" / str(time.monotonic_ns())
    spec_path = write_resolved(spec, root / "spec.yaml")
    py = sys.executable
    env = {**os.environ, "TRAINGATE_SPEC": str(spec_path), "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_RUN_ID", None)
    contract = str(Path(checks_init).with_name("test_recipe_contract.py"))

    def job_cmd(stage: str, stop_at_step: int | None = None, name: str | None = None) -> list[str]:
        # Both smoke commands share the run's checkpoint location: the second resumes from the first.
        job = derive(spec, stage, run_id=root.name, run_dir=root, settings=Settings.from_env(),
                     stage_dir=root / (name or stage))
        job = dataclasses.replace(job.launch(time.time()), tracking_uri=None, mlflow_run_id=None,
                                  stop_at_step=stop_at_step)
        job.write()
        return stage_command(job, py)

    plan = {
        "unit": [[py, "-m", "pytest", "-q", "-p", "no:cacheprovider", contract]],
        "smoke": [job_cmd("smoke", 3, "smoke-a"), job_cmd("smoke")],
        "canary": [job_cmd("canary")],
        "full": [job_cmd("full")],
    }
    out: dict[str, float] = {}
    for stage, cmds in plan.items():
        d = root / f"{stage}-cwd"
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for cmd in cmds:
            subprocess.run(cmd, env=env, cwd=d, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out[stage] = time.perf_counter() - t0
    return out


def _ladder() -> tuple[float, dict[str, float]]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pipeline import ladder
    from traingate.spec import load_spec

    t0 = time.perf_counter()
    state = ladder(load_spec(SPEC), "full", return_state=True)
    total = time.perf_counter() - t0
    assert state.is_completed(), state.message
    flow_run_id = state.result()["flow_run_id"]
    with get_client(sync_client=True) as c:
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200)
    trs = sorted(trs, key=lambda t: t.start_time)
    stages: dict[str, float] = {}
    names = ["unit", "smoke", "canary", "full"]
    opens = [t for t in trs if t.name.startswith("open-stage-run")]
    reports = [t for t in trs if t.name.startswith(("publish-stage-report", "report-"))]
    for name, o, r in zip(names, opens, reports):
        stages[name] = (r.end_time - o.start_time).total_seconds()
    return total, stages


def main() -> str:
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-ladder-"))
    os.environ["TRAINGATE_STATE_DIR"] = str(tmp / "state")
    os.environ.setdefault("PREFECT_HOME", str(tmp / "prefect"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
    from prefect.testing.utilities import prefect_test_harness

    t0 = time.perf_counter()
    with prefect_test_harness(server_startup_timeout=180):
        server_s = time.perf_counter() - t0
        rows = []
        for _ in range(REPEATS):
            bare = _bare(tmp)
            total, stages = _ladder()
            rows.append((bare, total, stages))
    bare_total = min(sum(b.values()) for b, _, _ in rows)
    ladder_total = min(t for _, t, _ in rows)
    lines = [f"Ladder on `examples/digits.yaml` (4 stages, best of {REPEATS}); Prefect server start "
             f"{server_s:.1f} s (once per `traingate run`, not included below).", "",
             "| stage | bare commands (s) | in the ladder (s) | orchestration overhead (s) |", "|---|---|---|---|"]
    for stage in ("unit", "smoke", "canary", "full"):
        b = min(r[0][stage] for r in rows)
        lad = min(r[2][stage] for r in rows)
        lines.append(f"| {stage} | {b:.1f} | {lad:.1f} | {lad - b:+.1f} |")
    lines += [f"| **total** | {bare_total:.1f} | {ladder_total:.1f} | {ladder_total - bare_total:+.1f} |", "",
              f"ratio ladder / bare = **{ladder_total / bare_total:.2f}x**"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
