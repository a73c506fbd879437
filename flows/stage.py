"""One training stage of a RunSpec as a flow of its own: no ladder before it, its gate after it.

For work that already passed the cheap stages (a retrain on new data, a long full run queued on a
shared pool) and for the scheduling tests: the stage goes through the one launch task, so it waits
for its gang slots in its pool's queue, may be preempted by a higher class and resumes by itself.
Tracked like a ladder stage (a pipeline run with one stage run in MLflow).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.states import Cancelled, Completed, Failed, State

from flows.pipeline import flow_settings, stopped, with_newest_data
from tasks.data import data_snapshot
from tasks.tracking import close_pipeline_run, open_pipeline_run, open_stage_run, record_stage
from tasks.train import budgets_at_gate, run_stage_job
from traingate.job.stagejob import derive
from traingate.job.vocab import Status
from traingate.ladder.gates import decide
from traingate.ladder.preflight import check_spec, preflight
from traingate.settings import LocationError
from traingate.spec import RunSpec, SpecError, Stage, write_resolved


@flow(name="stage", log_prints=True)
def train_stage(spec: RunSpec, stage: Stage = "full", faults: str | None = None) -> State:
    """Train ``spec``'s ``stage`` and judge it by its gate. ``faults``: a fault plan, for drills
    and tests only (traingate.runtime.inject)."""
    if stage == "unit":
        raise SpecError("stage = 'unit': the unit stage trains nothing; use the ladder flow for it")
    log = get_run_logger()
    try:
        settings = flow_settings()
    except LocationError as e:
        return stopped(Failed(message=str(e)), {})
    spec = with_newest_data(spec)
    check_spec(spec)
    preflight(spec, settings)
    settings.ensure()
    data_hash, data_uri = data_snapshot(spec)
    run_id = open_pipeline_run(spec, data_hash, data_uri)
    run_dir = settings.state_dir / "runs" / run_id
    write_resolved(spec, run_dir / "spec.yaml")
    stage_run = open_stage_run(run_id, stage)
    job = derive(spec, stage, run_id=run_id, run_dir=run_dir, settings=settings, mlflow_run_id=stage_run, faults=faults)
    result = run_stage_job(job)
    decision = decide(
        result, spec.gate(stage), spec.budget.max_cost_usd, budgets=budgets_at_gate(spec, run_id, run_dir, result)
    )
    record_stage(stage_run, result, decision, run_id=run_id)
    summary = {
        "run_id": run_id,
        "stage": stage,
        "status": str(result.status),
        "gate": decision.passed,
        "mlflow_run_id": stage_run,
        "checkpoint_uri": result.checkpoint_uri,
        "preemptions": result.metrics.get("preemptions", 0),
        "queue_wait_s": result.metrics.get("queue_wait_s"),
    }
    if result.status == Status.PREEMPTED:
        close_pipeline_run(run_id, False, stage, result.error or "preempted")
        return stopped(Cancelled(message=f"{stage} stopped: {result.error}"), summary)
    close_pipeline_run(run_id, decision.passed, stage, "" if decision.passed else decision.summary())
    if not decision.passed:
        return stopped(Failed(message=decision.summary()), summary)
    log.info(decision.summary())
    return Completed(message=f"{stage} passed its gate", data=summary)
