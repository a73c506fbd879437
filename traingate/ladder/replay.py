"""The orchestrator's writes that a lost tracking store could not take, kept and made again.

The writes (record a stage, close the pipeline, register the model) that the store could not take
are kept as calls in the run's journal (<run dir>/tracking/journal.jsonl) and made again, in order,
by `traingate replay`: each is idempotent, so a replay that repeats one is harmless.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from traingate.job.files import JOB
from traingate.job.result import GateDecision, StageResult
from traingate.job.stagejob import StageJob
from traingate.promotion.register import register_candidate
from traingate.spec import load_spec
from traingate.tracking.journal import Journal, journal_path, pending_bytes
from traingate.tracking.runs import close_pipeline_run, record_stage
from traingate.tracking.tracker import MlflowTracker

REPLAYABLE = ("record_stage", "close_pipeline_run", "register_candidate")


def keep_for_replay(run_dir: Path, call: str, **args: Any) -> Path:
    """Keep one orchestrator write for `traingate replay`; returns the journal that holds it."""
    assert call in REPLAYABLE, call
    path = journal_path(run_dir)
    with Journal(path) as j:
        j.append([{"call": call, "args": json.loads(json.dumps(args, default=str)), "t": int(time.time() * 1000)}])
    return path


def replay_calls(c: MlflowClient, run_dir: Path) -> list[tuple[str, Any]]:
    """Make the orchestrator writes kept in ``run_dir``'s journal, in order; returns (call, result) per write.

    Each is marked delivered once made, so an interrupted replay goes on where it stopped. Raises what
    the store raises (still unreachable: :func:`traingate.tracking.runs.store_unreachable`), leaving the rest kept.
    """
    path = journal_path(run_dir)
    if not path.exists():
        return []
    done: list[tuple[str, Any]] = []
    with Journal(path) as j:
        while pending := j.read_pending(100):
            for record, end in pending:
                done.append((record["call"], _make(c, run_dir, record["call"], record["args"])))
                j.commit(end)
    return done


def _make(c: MlflowClient, run_dir: Path, call: str, args: dict[str, Any]) -> Any:
    if call == "record_stage":
        decision = args["decision"]
        record_stage(
            c,
            args["stage_run_id"],
            StageResult.from_dict(args["result"]),
            GateDecision(**{**decision, "evaluated": [tuple(e) for e in decision["evaluated"]]})
            if decision is not None
            else None,
        )
        return None
    if call == "close_pipeline_run":
        return close_pipeline_run(c, **args)
    if call == "register_candidate":
        # The run's resolved spec, as `traingate resume` reads it (secrets stay references).
        return register_candidate(
            c, load_spec(Path(run_dir) / "spec.yaml"), args["stage_run_id"], args["checkpoint_uri"]
        )
    raise ValueError(f"journal {Path(run_dir) / 'tracking'}: unknown call {call!r}; replayable: {REPLAYABLE}")


def replay_stage(tracking_uri: str, stage_dir: Path, timeout_s: float) -> int:
    """Deliver a finished stage's journal into its stage run (the tracker's own replay); returns bytes left."""
    journal = journal_path(stage_dir)
    if not pending_bytes(journal):
        return 0
    job = StageJob.read(Path(stage_dir) / JOB)
    if not job.mlflow_run_id:
        raise ValueError(f"{stage_dir}: its job.json names no MLflow run (tracking was off); nothing to replay into")
    # Closing at once: the writer thread delivers everything pending, for up to timeout_s, then stops.
    MlflowTracker(tracking_uri, job.mlflow_run_id, journal.parent, drain_timeout_s=timeout_s).close()
    return pending_bytes(journal)
