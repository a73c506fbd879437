"""`traingate resume RUN_ID [--until STAGE]`: continue a preempted or failed run from its latest checkpoint.

Finds the run's first unfinished training stage under the state dir, relaunches it
(same run id, same MLflow stage run, latest valid checkpoint) as the Prefect flow
`resume`, gates it, and by default stops there; ``--until full`` climbs on.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from traingate.spec import STAGES, TRAINING_STAGES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id", help="the traingate run id (printed by `traingate run`)")
    p.add_argument("--until", choices=STAGES, default=None,
                   help="last stage to run (default: only the interrupted stage)")


def interrupted_stage(run_dir: Path) -> str | None:
    """The first training stage of the run that started and did not complete."""
    for stage in TRAINING_STAGES:
        state_path = run_dir / stage / "supervisor.json"
        if not state_path.exists():
            continue
        final = (json.loads(state_path.read_text()).get("final") or {})
        if final.get("status") != "completed":
            return stage
    return None


def main(args: argparse.Namespace) -> int:
    from traingate.settings import Settings

    settings = Settings.from_env()
    run_dir = settings.state_dir / "runs" / args.run_id
    if not (run_dir / "spec.yaml").exists():
        print(f"traingate resume: no run {args.run_id!r} under {settings.state_dir / 'runs'}; "
              "pass the run id `traingate run` printed (and the same TRAINGATE_STATE_DIR)")
        return 2
    stage = interrupted_stage(run_dir)
    if stage is None:
        print(f"traingate resume: run {args.run_id} has no interrupted training stage; nothing to resume")
        return 0
    until = args.until or stage
    if STAGES.index(until) < STAGES.index(stage):
        print(f"traingate resume: --until {until} is before the interrupted stage {stage}")
        return 2
    state = resume_flow(args.run_id, stage, until, return_state=True)
    data = state.result(raise_on_failure=False)
    print(f"resume {'PASSED' if state.is_completed() else 'STOPPED'}: {state.message}")
    if isinstance(data, dict):
        for name, info in data["stages"].items():
            print(f"  {name:<7} {info['status']:<10} gate {'passed' if info['gate'] else 'FAILED':<7} "
                  f"restarts {info['restarts']}  resumed from step {info['resumed_from_step']}")
    print(f"  Prefect UI: PREFECT_HOME={os.environ.get('PREFECT_HOME', '')} prefect server start")
    return 0 if state.is_completed() else 1


def _flow():
    from prefect import flow, get_run_logger
    from prefect.states import Cancelled, Completed, Failed

    from tasks.report import publish_stage_report
    from tasks.tracking import open_stage_run, record_stage
    from tasks.train import run_training_stage
    from traingate.gates import decide
    from traingate.settings import Settings
    from traingate.spec import load_spec
    from traingate.supervision.supervisor import read_state

    @flow(name="resume", log_prints=True)
    def resume(run_id: str, stage: str, until: str) -> Any:
        log = get_run_logger()
        run_dir = Settings.from_env().state_dir / "runs" / run_id
        spec_path = run_dir / "spec.yaml"
        spec = load_spec(spec_path)
        summary: dict[str, Any] = {"run_id": run_id, "stages": {}}
        for name in TRAINING_STAGES[TRAINING_STAGES.index(stage):TRAINING_STAGES.index(until) + 1]:
            stage_dir = run_dir / name
            previous = read_state(stage_dir) if name == stage else None
            mlflow_run = (previous or {}).get("launch", {}).get("mlflow_run_id") or open_stage_run(run_id, name)
            result = run_training_stage(spec, name, run_id, str(spec_path), str(stage_dir), mlflow_run,
                                        resume=name == stage)
            decision = decide(result, spec.gate(name), spec.budget.max_cost_usd)
            record_stage(mlflow_run, result, decision)
            publish_stage_report(run_id, result, decision)
            summary["stages"][name] = {"status": result.status, "gate": decision.passed,
                                       "restarts": result.metrics.get("restarts", 0),
                                       "resumed_from_step": result.metrics.get("resumed_from_step", 0)}
            if result.status == "preempted":
                return Cancelled(message=result.error, data=summary)
            if not decision.passed:
                return Failed(message=decision.summary(), data=summary)
            log.info(decision.summary())
        return Completed(message=f"resumed {stage}; reached {until}", data=summary)
    return resume


def resume_flow(*args: Any, **kwargs: Any) -> Any:
    return _flow()(*args, **kwargs)
