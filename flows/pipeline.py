"""The ladder: unit -> smoke -> canary -> full, a gate after each stage."""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed, Failed, State

from tasks.data import data_snapshot
from tasks.report import publish_stage_report
from tasks.tracking import (close_pipeline_run, open_pipeline_run, open_stage_run, record_stage,
                            register_candidate)
from tasks.train import run_training_stage
from tasks.unit import run_unit_tests
from traingate.gates import decide
from traingate.plan import stages_until
from traingate.settings import Settings
from traingate.spec import Stage, load_spec, write_resolved
from traingate.validate import check_spec


class Approval(RunInput):
    approve: bool
    reviewer: str = ""
    reason: str = ""


@flow(name="pipeline", log_prints=True)
def pipeline(spec_path: str, overrides: list[str] | None = None, until: Stage = "full") -> State:
    log = get_run_logger()
    spec = load_spec(spec_path, overrides or [])
    check_spec(spec)
    settings = Settings.from_env().ensure()

    data_hash, data_uri = data_snapshot(spec)
    run_id = open_pipeline_run(spec, data_hash, data_uri)
    run_dir = settings.state_dir / "runs" / run_id
    resolved = write_resolved(spec, run_dir / "spec.yaml")
    summary: dict[str, Any] = {"run_id": run_id, "flow_run_id": str(flow_run.id), "stages": {},
                               "run_dir": str(run_dir)}
    stages = stages_until(until)
    for i, stage in enumerate(stages):
        stage_run = open_stage_run(run_id, stage)
        stage_dir = str(run_dir / stage)
        if stage == "unit":
            result = run_unit_tests(spec, str(resolved), stage_dir)
        else:
            result = run_training_stage(spec, stage, run_id, str(resolved), stage_dir, stage_run)
        gate = spec.gate(stage)
        decision = decide(result, gate, spec.budget.max_cost_usd)
        record_stage(stage_run, result, decision)
        publish_stage_report(run_id, result, decision)
        summary["stages"][stage] = {"status": result.status, "gate": decision.passed, "mlflow_run_id": stage_run,
                                    "checkpoint_uri": result.checkpoint_uri, "cost_usd": result.cost_usd}
        summary["checkpoint_uri"] = result.checkpoint_uri or summary.get("checkpoint_uri")
        if result.status == "preempted":  # cancelled from the UI/API: checkpointed, resumable
            close_pipeline_run(run_id, False, stage, result.error or "preempted")
            return Cancelled(message=f"{stage} preempted at a checkpoint; continue with: traingate resume {run_id}",
                             data=summary)
        if not decision.passed:
            close_pipeline_run(run_id, False, stage, decision.summary())
            return Failed(message=decision.summary(), data=summary)
        log.info(decision.summary())
        if gate.require_approval and i + 1 < len(stages):
            answer = pause_flow_run(wait_for_input=Approval, timeout=int(gate.approval_timeout_s),
                                    key=f"approve-{stages[i + 1]}")
            if not answer.approve:
                reason = f"promotion to {stages[i + 1]} rejected by {answer.reviewer or 'reviewer'}: {answer.reason}"
                close_pipeline_run(run_id, False, stage, reason)
                return Failed(message=reason, data=summary)
            log.info("promotion to %s approved by %s", stages[i + 1], answer.reviewer or "reviewer")
    if stages[-1] == "full":  # promotion: registered only if the run's identity is complete
        summary["model"] = register_candidate(spec, summary["stages"]["full"]["mlflow_run_id"],
                                              summary.get("checkpoint_uri"))
    close_pipeline_run(run_id, True, stages[-1])
    return Completed(message=f"all {len(stages)} stages passed", data=summary)
