"""The records of a supervision: what its caller plugs in (Hooks) and gets back (Supervision), one
Attempt per launch, and ``supervisor.json`` (:mod:`traingate.job.files`) that keeps them on disk.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from traingate.job import files
from traingate.job.stagejob import StageJob
from traingate.job.vocab import Cause, Status
from traingate.launch import proc
from traingate.supervision import causes
from traingate.supervision.checkpoints import is_disk_full

log = logging.getLogger(__name__)

TAIL_LINES = 50


@dataclass
class Attempt:
    number: int
    launched_at: float  # epoch seconds
    ended_at: float | None = None  # when the failure was seen (exit, hang, or an in-place restart)
    returncode: int | None = None
    cause: Cause | None = None  # None: completed
    retryable: bool = False
    detail: str = ""
    inplace: bool = False  # torchrun restarted the group in place to start this attempt
    start_steps: dict[int, int] = field(default_factory=dict)  # rank -> step it resumed from
    end_step: int | None = None  # last step rank 0 reported
    first_step_time: float | None = None  # rank 0's first completed step of this attempt
    timeline: dict[str, float] = field(default_factory=dict)  # rank 0's start-up: process start .. checkpoint loaded
    backoff_s: float = 0.0  # waited after this attempt, before the next launch
    overrides: list[str] = field(default_factory=list)  # spec changes of this launch (OOM policy)
    last_words: list[dict[str, Any]] = field(default_factory=list)
    # Written to supervisor.json before the launch (write-ahead): what it runs and the checkpoint it starts
    # from, so a supervisor killed while it runs leaves a record `traingate resume` can close and go on from.
    command: list[str] = field(default_factory=list)
    resume_from_step: int | None = None  # the newest checkpoint on disk at launch (None: none)
    # A script resumed from a checkpoint whose file name holds no step (ckpt.pt): the step is unknown.
    resume_step_unknown: bool = False

    @property
    def start_step(self) -> int | None:
        return self.start_steps.get(0)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Attempt:
        """An attempt as ``supervisor.json`` holds it (fields this version does not know are left out)."""
        return cls(**{k: v for k, v in record.items() if k in _FIELDS})


_FIELDS = frozenset(f.name for f in fields(Attempt))


@dataclass
class Hooks:
    """What the caller (a Prefect task, the drill, a test) plugs in. All optional."""

    on_line: Callable[[str], None] | None = None
    info: Callable[[str], None] = log.info
    error: Callable[[str], None] | None = None  # a critical alert's line (ERROR in a log); None: through info
    on_restart: Callable[[dict[str, Any]], None] | None = None
    on_alert: Callable[[str, dict[str, Any]], None] | None = None
    # Polled while the tree runs and during backoff; a reason string means "preempt it now, do not restart".
    stop_requested: Callable[[], str | None] | None = None
    # Called every tick while the tree runs (a sweep trial feeds its progress to the pruner here).
    on_tick: Callable[[], None] | None = None
    # Called as each launch's processes have ended, before the supervisor judges the launch.
    on_exit: Callable[[], None] | None = None


@dataclass
class Supervision:
    status: Status
    cause: Cause | None  # the cause of the last attempt's end (None when completed)
    error: str | None  # cause, detail and (for a stop) the last log lines
    attempts: list[Attempt]
    proc: proc.ProcResult  # the last launch
    stop_reason: str | None = None
    job: StageJob | None = None  # the last attempt's job
    # Who paused a resumable stage: "alert <rule>" (a budget's rule too) or "disk full"; None when it was
    # preempted (Ctrl-C, a cancelled flow run, a higher priority class) or did not pause.
    paused_by: str | None = None
    # A stage stopped from outside (preempted, paused): whether its emergency checkpoint was confirmed; None for any
    # other end.
    checkpointed: bool | None = None

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": str(self.status),
            "cause": self.cause,
            "error": self.error,
            "stop_reason": self.stop_reason,
            "paused_by": self.paused_by,
            "checkpointed": self.checkpointed,
            "restarts": self.restarts,
            "attempts": [asdict(a) for a in self.attempts],
        }


class Record:
    """supervisor.json: who runs this stage, every attempt, and the verdict."""

    def __init__(self, job: StageJob, earlier: list[dict[str, Any]]):
        self.dir = Path(job.stage_dir)
        self.state = files.SupervisorState(
            job={
                "run_id": job.run_id,
                "stage": job.stage,
                "kind": str(job.kind),
                "mlflow_run_id": job.mlflow_run_id,
                "checkpoint_uri": job.checkpoint_uri,
                "run_dir": job.run_dir,
            },
            supervisor_pid=os.getpid(),
        )
        self.earlier = earlier

    def write(self, attempts: list[Attempt], final: dict[str, Any] | None = None) -> None:
        self.state.attempts = [*self.earlier, *[asdict(a) for a in attempts]]
        self.state.final = final
        try:
            files.write_supervisor_state(self.dir, self.state)
        except OSError as e:
            if not is_disk_full(e):
                raise
            # A full state directory is the verdict this supervision reports (disk_full), not a second
            # failure: the attempts stay in the returned Supervision, and the next write tries again.
            log.warning("supervisor.json not updated: %s", e)


def earlier_attempts(stage_dir: Path, resumed: files.SupervisorState | None) -> list[dict[str, Any]]:
    """The attempts of an earlier, interrupted supervision of this stage; one it left running is closed
    (:func:`orphaned`)."""
    earlier = list(resumed.attempts) if resumed else []
    if earlier and earlier[-1].get("ended_at") is None:
        earlier[-1] = orphaned(earlier[-1], len(earlier) - 1, stage_dir, resumed.supervisor_pid if resumed else None)
    return earlier


def orphaned(record: dict[str, Any], number: int, stage_dir: Path, supervisor_pid: int | None) -> dict[str, Any]:
    """An attempt the record shows as running whose supervisor is gone (killed with the CLI): closed as
    ``orchestrator_lost`` at the last sign of life of its processes, with the step rank 0 last reported
    (a script's: the last its output showed, from the metric points of attempt ``number``)."""
    beats = files.read_heartbeats(stage_dir)
    words = files.read_last_words(stage_dir)
    out = stage_dir / files.STDOUT
    seen = [b.time for b in beats.values()] + [w.time for w in words]
    if out.exists():
        seen.append(out.stat().st_mtime)
    launched = float(record.get("launched_at") or 0.0)
    shown = [p.step for p in files.read_script_points(stage_dir) if p.attempt == number]
    primary = causes.primary_words(words)
    detail = f"its supervisor (pid {supervisor_pid or '?'}) died while it ran"
    if primary:
        detail += f"; rank {primary[0].rank}: {primary[0].error}"
    return {
        **record,
        "ended_at": max([launched, *seen]),
        "cause": str(Cause.ORCHESTRATOR_LOST),
        "retryable": True,
        "detail": detail,
        "end_step": beats[0].step if 0 in beats else max(shown, default=record.get("end_step")),
        "last_words": [asdict(w) for w in words],
    }


def read_state(stage_dir: Path) -> files.SupervisorState | None:
    """What a supervisor wrote about a stage (for `traingate resume` and drills)."""
    return files.read_supervisor_state(stage_dir)
