"""The words both sides of the process boundary use: how a stage ended, and why it failed.

One enum each, shared by the runtime, the supervisor, StageResult and sweep trials.
They are ``StrEnum``s: they serialise as their value and compare equal to it, so files
written before the enums existed still read the same.

>>> Status("completed") is Status.COMPLETED
True
>>> Cause.WORKER_LOST in RETRYABLE, Cause.USER_ERROR in RETRYABLE
(True, False)
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    COMPLETED = "completed"  # ran to its step limit (or its tests ran)
    STOPPED = "stopped"  # stopped on purpose at a checkpoint (smoke's first half, a sweep's on_progress)
    PREEMPTED = "preempted"  # SIGTERM honoured: emergency checkpoint written, resumable
    PRUNED = "pruned"  # a sweep trial the scheduler stopped early
    DIVERGED = "diverged"  # non-finite loss beyond optim.nonfinite_tolerance
    FAILED = "failed"  # any other end; the cause says why
    SKIPPED = "skipped"  # not run (a resumed ladder's finished stages)


class Cause(StrEnum):
    PREEMPTED = "preempted"
    WORKER_LOST = "worker_lost"
    HANG = "hang"
    COLLECTIVE_TIMEOUT = "collective_timeout"
    TRANSIENT_IO = "transient_io"
    CHECKPOINT_ERROR = "checkpoint_error"  # the checkpoint store failed after in-process retries
    DISK_FULL = "disk_full"
    OOM = "oom"
    DIVERGED = "diverged"
    USER_ERROR = "user_error"  # bad config, a bug in recipe code, a refused checkpoint
    TIMEOUT = "timeout"  # the stage's own time limit
    ORCHESTRATOR_LOST = "orchestrator_lost"  # the supervisor died; the tree checkpointed and exited
    ROLLBACK = "rollback"  # an alert rolled the stage back to a checkpoint before it
    ALERT = "alert"  # an alert's action stopped the stage for good


# A restart from the latest checkpoint can fix these; it cannot fix a bad config, a bug, NaN math or a
# full disk. OOM is retryable only under the opt-in OOM policy (see traingate.supervision.oom).
RETRYABLE = frozenset(
    {
        Cause.PREEMPTED,
        Cause.WORKER_LOST,
        Cause.HANG,
        Cause.COLLECTIVE_TIMEOUT,
        Cause.TRANSIENT_IO,
        Cause.CHECKPOINT_ERROR,
    }
)


# Failures torchrun may answer with an in-place restart of the group; any other needs the supervisor
# (a bug or NaN must stop, an OOM restarts with a smaller batch, a full disk stays full). The rank that
# fails with one of those stops its agent itself (traingate.runtime.train), so a restart forked in
# milliseconds from a zygote cannot begin before the supervisor's stop arrives.
# A preemption of the group is one too: its agent (traingate.runtime.agent) outlives the SIGTERM.
INPLACE_OK = frozenset(
    {Cause.WORKER_LOST, Cause.PREEMPTED, Cause.COLLECTIVE_TIMEOUT, Cause.TRANSIENT_IO, Cause.CHECKPOINT_ERROR}
)


def status_for(cause: Cause | str | None) -> Status:
    """The status a stage ends in when its last launch ended with ``cause`` (None: completed)."""
    if cause is None:
        return Status.COMPLETED
    return {Cause.DIVERGED: Status.DIVERGED, Cause.PREEMPTED: Status.PREEMPTED}.get(Cause(cause), Status.FAILED)


# The faults `traingate drill` injects (traingate.supervision.drill), and the ones it cycles through by default.
DRILL_KINDS = ("kill", "term", "stop", "io", "ctimeout")
DEFAULT_KINDS = ("kill", "term", "stop", "io")
