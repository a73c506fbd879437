"""MLflow boundary of the ladder: open the runs, record each stage, close."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from traingate.settings import Settings
from traingate.spec import RunSpec
from traingate.stage import GateDecision, StageResult
from traingate.tracking import runs
from traingate.tracking.identity import code_version, environment_snapshot

_MLFLOW = dict(cache_policy=NONE, retries=3, retry_delay_seconds=[1, 5, 15])


@task(name="open-pipeline-run", **_MLFLOW)
def open_pipeline_run(spec: RunSpec, data_snapshot: str, data_uri: str) -> str:
    s = Settings.from_env()
    identity = {"code": code_version(), "data_snapshot": data_snapshot, "data_uri": data_uri,
                "environment": environment_snapshot()}
    return runs.open_pipeline_run(runs.client(s.tracking_uri), spec, s.artifact_uri, identity)


@task(name="open-stage-run", **_MLFLOW)
def open_stage_run(parent_run_id: str, stage: str) -> str:
    return runs.open_stage_run(runs.client(Settings.from_env().tracking_uri), parent_run_id, stage)


@task(name="record-stage", **_MLFLOW)
def record_stage(stage_run_id: str, result: StageResult, decision: GateDecision | None) -> None:
    runs.record_stage(runs.client(Settings.from_env().tracking_uri), stage_run_id, result, decision)


@task(name="close-pipeline-run", **_MLFLOW)
def close_pipeline_run(run_id: str, passed: bool, reached: str, reason: str = "") -> None:
    runs.close_pipeline_run(runs.client(Settings.from_env().tracking_uri), run_id, passed, reached, reason)


@task(name="register-candidate", **_MLFLOW)
def register_candidate(spec: RunSpec, stage_run_id: str, checkpoint_uri: str | None) -> dict:
    """Promotion of the full stage: log and register its final model with alias `candidate` (if it may be)."""
    from traingate.tracking.registry import register_candidate as register

    return register(runs.client(Settings.from_env().tracking_uri), spec, stage_run_id, checkpoint_uri)
