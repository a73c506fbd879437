"""MLflow boundary of the ladder: open the runs, record each stage, close.

Every task here is retried, so every one is idempotent: re-recording writes the same values,
and the tasks that create (a run, a model version) pass a request key that a retry repeats,
so a retry finds what its failed attempt created instead of creating it twice.

A lost tracking store never fails the flow at the writes after a stage (record-stage,
close-pipeline-run, register-candidate): when the store stays unreachable through the retries,
the write is kept in the run's journal (``<run dir>/tracking/journal.jsonl``), one line says so,
and ``traingate replay RUN_ID`` makes it later (:mod:`traingate.tracking.runs`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.runtime import task_run

from tasks.report import publish_stage_report
from traingate.job import envvars
from traingate.job.result import GateDecision, StageResult
from traingate.ladder import replay
from traingate.promotion.register import register_candidate as register
from traingate.settings import Settings
from traingate.spec import RunSpec
from traingate.tracking import journal, runs
from traingate.tracking.identity import environment_snapshot, run_code_version

_DELAYS_S = [1, 5, 15]
_MLFLOW: dict[str, Any] = dict(cache_policy=NONE, retries=3, retry_delay_seconds=_DELAYS_S)
_journal_lock = threading.Lock()  # recording tasks run in threads beside each other; a journal has one writer


def request_key(kind: str) -> runs.RequestKey:
    """A key naming one create request: the same for every retry of the calling task run, fresh in its first.

    Prefect retries a task inside the same task run, so its id is the key. Called as a plain
    function (``.fn``), nothing retries it: a fresh key.
    """
    if task_run.id is None:
        return runs.RequestKey(f"{kind}-{uuid.uuid4()}", fresh=True)
    return runs.RequestKey(f"{kind}-{task_run.id}", fresh=task_run.run_count <= 1)


@task(name="open-pipeline-run", **_MLFLOW)
def open_pipeline_run(
    spec: RunSpec, data_snapshot: str, data_uri: str, validate: bool = True, fill: bool = True
) -> str:
    """The run's MLflow parent run. ``validate``: its identity checked and tagged now; False: the caller runs
    :func:`check_identity` (beside its next steps). ``fill``: its params and identity artifacts written now;
    False: its tags only (what its stage runs inherit), and the caller runs :func:`fill_pipeline_run` (beside its
    next steps; it checks the identity too)."""
    s = Settings.from_env()
    # A script run is versioned by its project (git, or the content of a git-less one), not by traingate.
    identity: dict[str, Any] = {
        "code": run_code_version(spec, s.state_dir),
        "data_snapshot": data_snapshot,
        "data_uri": data_uri,
    }
    if fill:
        identity["environment"] = environment_snapshot()
    return runs.open_pipeline_run(
        runs.client(s.tracking_uri),
        spec,
        s.artifact_uri,
        identity,
        request_key=request_key("pipeline"),
        validate=validate,
    )


@task(name="fill-pipeline-run", **_MLFLOW)
def fill_pipeline_run(run_id: str, spec: RunSpec) -> list[str]:
    """A parent run opened without ``fill``: its params, spec and environment snapshot, then its identity check;
    what the stored run lacks of its identity (tagged on it as the verdict)."""
    c = runs.client(Settings.from_env().tracking_uri)
    return runs.fill_pipeline_run(c, run_id, spec, environment_snapshot())


@task(name="check-identity", **_MLFLOW)
def check_identity(run_id: str) -> list[str]:
    """What the stored run lacks of its identity (tagged on it as the verdict); empty when complete."""
    return runs.validate_identity(runs.client(Settings.from_env().tracking_uri), run_id)


@task(name="open-stage-run", **_MLFLOW)
def open_stage_run(parent_run_id: str, stage: str) -> str:
    return runs.open_stage_run(
        runs.client(Settings.from_env().tracking_uri), parent_run_id, stage, request_key=request_key(f"stage-{stage}")
    )


@task(name="create-stage-run", task_run_name="create-stage-run-{stage}", **_MLFLOW)
def create_stage_run(parent_run_id: str, stage: str) -> str:
    """A stage's run, its id and identity tags only: :func:`fill_stage_run` writes the rest beside the stage."""
    return runs.create_stage_run(
        runs.client(Settings.from_env().tracking_uri), parent_run_id, stage, request_key=request_key(f"stage-{stage}")
    )


@task(name="fill-stage-run", task_run_name="fill-stage-run-{stage}", **_MLFLOW)
def fill_stage_run(parent_run_id: str, stage_run_id: str, stage: str) -> None:
    runs.fill_stage_run(runs.client(Settings.from_env().tracking_uri), parent_run_id, stage_run_id, stage)


@task(name="record-stage", task_run_name="record-{result.stage}", **_MLFLOW)
def record_stage(
    stage_run_id: str,
    result: StageResult,
    decision: GateDecision | None,
    run_id: str | None = None,
    report: bool = False,
) -> None:
    """``run_id``: the pipeline's, whose journal keeps the write if the store is gone (None: it fails instead).
    ``report``: the stage's report in the Prefect UI too (:func:`tasks.report.publish_stage_report`), after its
    MLflow records, in this task run (a task run costs the Prefect server about 20 ms of CPU)."""
    c = runs.client(Settings.from_env().tracking_uri)
    _write_or_keep(
        run_id,
        f"record-stage of {result.stage}",
        "record_stage",
        {
            "stage_run_id": stage_run_id,
            "result": result.to_dict(),
            "decision": decision.__dict__ if decision is not None else None,
        },
        lambda: runs.record_stage(c, stage_run_id, result, decision),
    )
    if report:
        assert run_id is not None, "a stage's report is keyed by its pipeline run"
        publish_stage_report.fn(run_id, result, decision, stage_run_id)


@task(name="close-pipeline-run", **_MLFLOW)
def close_pipeline_run(run_id: str, passed: bool, reached: str, reason: str = "") -> None:
    c = runs.client(Settings.from_env().tracking_uri)
    _write_or_keep(
        run_id,
        "close-pipeline-run",
        "close_pipeline_run",
        {"run_id": run_id, "passed": passed, "reached": reached, "reason": reason},
        lambda: runs.close_pipeline_run(c, run_id, passed, reached, reason),
    )
    # The pipeline's last write: say once what the store still lacks and how to deliver it.
    left = sum(journal.pending_bytes(p) for p in journal.journals_of(_run_dir(run_id)))
    if left:
        get_run_logger().warning(
            "tracking store is missing %.1f KiB of run %s's records (kept in its journals under %s); deliver them "
            "when the store is back: traingate replay %s",
            left / 1024,
            run_id,
            _run_dir(run_id),
            run_id,
        )


@task(name="register-candidate", **_MLFLOW)
def register_candidate(spec: RunSpec, stage_run_id: str, checkpoint_uri: str | None, run_id: str | None = None) -> dict:
    """Promotion of the full stage: log and register its final model with alias `candidate` (if it may be).

    Idempotent without a key: a stage run has at most one version (see traingate.promotion.register).
    ``run_id``: as for :func:`record_stage` (a kept registration is made by `traingate replay`).
    """

    c = runs.client(Settings.from_env().tracking_uri)
    out = _write_or_keep(
        run_id,
        "register-candidate",
        "register_candidate",
        {"stage_run_id": stage_run_id, "checkpoint_uri": checkpoint_uri},
        lambda: register(c, spec, stage_run_id, checkpoint_uri),
    )
    if out is None:
        return {
            "registered": False,
            "reasons": [
                f"tracking store unreachable: the registration waits in the run's "
                f"journal; make it with `traingate replay {run_id}`"
            ],
        }
    return out


def _run_dir(run_id: str):
    return Settings.from_env().state_dir / "runs" / run_id


def _write_or_keep(run_id: str | None, what: str, call: str, args: dict[str, Any], write: Callable[[], Any]) -> Any:
    """Make one write, retrying while the store is unreachable; after the last retry keep it for replay (None).

    The retries are here rather than Prefect's for this one failure, so a lost store costs one log line
    instead of a traceback per attempt. Writes kept earlier are made first, so the store gets them in order.
    """
    if run_id is None:  # nowhere to keep it: Prefect's retries, then the flow fails, as before
        return write()
    run_dir = _run_dir(run_id)
    error: BaseException | None = None
    with _journal_lock:
        if journal.pending_bytes(journal.journal_path(run_dir)):
            try:
                replay.replay_calls(runs.client(Settings.from_env().tracking_uri), run_dir)
            except Exception as e:  # noqa: BLE001 - re-raised unless the store is unreachable
                if not runs.store_unreachable(e):
                    raise
                error = e
        if error is None:
            for delay in [*envvars.tracking_retry_s(), None]:
                try:
                    return write()
                except Exception as e:  # noqa: BLE001 - re-raised unless the store is unreachable
                    if not runs.store_unreachable(e):
                        raise
                    error = e
                if delay is not None:
                    time.sleep(delay)
        path = replay.keep_for_replay(run_dir, call, **args)
    get_run_logger().warning(
        "tracking store unreachable (%s): %s kept in %s; deliver it later with: traingate replay %s",
        str(error).splitlines()[0][:160],
        what,
        path,
        run_id,
    )
    return None


@task(name="read-gate", cache_policy=NONE, retries=2, retry_delay_seconds=[1, 5])
def gate_passed(stage_run_id: str) -> bool:
    """Whether a recorded stage passed its gate (a resume that finds every stage done promotes only then)."""
    tags = runs.client(Settings.from_env().tracking_uri).get_run(stage_run_id).data.tags
    return tags.get("traingate.gate_passed") == "true"
