"""MLflow boundary of the ladder: open the runs, record each stage, close.

Every task here is retried, so every one is idempotent: re-recording writes the same values,
and the tasks that create (a run, a model version) pass a request key that a retry repeats,
so a retry finds what its failed attempt created instead of creating it twice.
"""
from __future__ import annotations

import uuid

from prefect import task
from prefect.cache_policies import NONE
from prefect.runtime import task_run

from traingate.settings import Settings
from traingate.spec import RunSpec
from traingate.stage import GateDecision, StageResult
from traingate.tracking import runs
from traingate.tracking.identity import code_version, environment_snapshot

_MLFLOW = dict(cache_policy=NONE, retries=3, retry_delay_seconds=[1, 5, 15])


def request_key(kind: str) -> str:
    """A key naming one create request: the same for every retry of the calling task run.

    Prefect retries a task inside the same task run, so its id is the key. Called as a plain
    function (``.fn``), nothing retries it: a fresh key.
    """
    return f"{kind}-{task_run.id or uuid.uuid4()}"


@task(name="open-pipeline-run", **_MLFLOW)
def open_pipeline_run(spec: RunSpec, data_snapshot: str, data_uri: str) -> str:
    s = Settings.from_env()
    identity = {"code": code_version(), "data_snapshot": data_snapshot, "data_uri": data_uri,
                "environment": environment_snapshot()}
    return runs.open_pipeline_run(runs.client(s.tracking_uri), spec, s.artifact_uri, identity,
                                  request_key=request_key("pipeline"))


@task(name="open-stage-run", **_MLFLOW)
def open_stage_run(parent_run_id: str, stage: str) -> str:
    return runs.open_stage_run(runs.client(Settings.from_env().tracking_uri), parent_run_id, stage,
                               request_key=request_key(f"stage-{stage}"))


@task(name="record-stage", **_MLFLOW)
def record_stage(stage_run_id: str, result: StageResult, decision: GateDecision | None) -> None:
    runs.record_stage(runs.client(Settings.from_env().tracking_uri), stage_run_id, result, decision)


@task(name="close-pipeline-run", **_MLFLOW)
def close_pipeline_run(run_id: str, passed: bool, reached: str, reason: str = "") -> None:
    runs.close_pipeline_run(runs.client(Settings.from_env().tracking_uri), run_id, passed, reached, reason)


@task(name="register-candidate", **_MLFLOW)
def register_candidate(spec: RunSpec, stage_run_id: str, checkpoint_uri: str | None) -> dict:
    """Promotion of the full stage: log and register its final model with alias `candidate` (if it may be).

    Idempotent without a key: a stage run has at most one version (see traingate.tracking.registry).
    """
    from traingate.tracking.registry import register_candidate as register

    return register(runs.client(Settings.from_env().tracking_uri), spec, stage_run_id, checkpoint_uri)


@task(name="read-gate", cache_policy=NONE, retries=2, retry_delay_seconds=[1, 5])
def gate_passed(stage_run_id: str) -> bool:
    """Whether a recorded stage passed its gate (a resume that finds every stage done promotes only then)."""
    tags = runs.client(Settings.from_env().tracking_uri).get_run(stage_run_id).data.tags
    return tags.get("traingate.gate_passed") == "true"
