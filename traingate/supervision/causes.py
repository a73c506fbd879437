"""Why a training process tree ended, and whether a restart can help.

Evidence, strongest first: what the supervisor itself did (killed a hung tree,
stopped it on request), ``result.json`` (rank 0's own verdict), the ranks' last
words, a rank killed by a signal (from torchrun's failure summary or our own exit
status), and finally the exit code. The vocabulary is :class:`traingate.job.vocab.Cause`;
the training process names its own errors with :mod:`traingate.runtime.failures`.

>>> from traingate.job.files import LastWords
>>> classify(Evidence(returncode=-9)).cause
<Cause.WORKER_LOST: 'worker_lost'>
>>> c = classify(Evidence(returncode=1, last_words=[LastWords(0, "user_error", "KeyError: 'x'", 1.0, 64)]))
>>> c.cause, c.retryable
(<Cause.USER_ERROR: 'user_error'>, False)
>>> classify(Evidence(returncode=-15, stop_requested=True)).cause  # the stop reached a rank still starting
<Cause.PREEMPTED: 'preempted'>
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field, replace

from traingate.job.files import LastWords
from traingate.job.vocab import INPLACE_OK, RETRYABLE, Cause, Status
from traingate.runtime import exitcodes

# torchrun's failure summary: "exitcode  : -9 (pid: 123)" for a worker killed by SIGKILL.
_TORCHRUN_SIGNAL = re.compile(r"exitcode\s*:\s*-(\d+)")
# Last-words causes that are only an echo of another rank's failure.
_ECHOES = {Cause.WORKER_LOST}
_LOST = "rank {rank} ended without last words (killed); its peers' SIGTERM was torchrun stopping the group"
# What the supervisor's stop of a tree sends: SIGTERM, then SIGKILL to what outlives the grace.
_STOP_SIGNALS = {signal.SIGTERM.value, signal.SIGKILL.value}
NOT_CHECKPOINTED = "stopped on request before its emergency checkpoint"


@dataclass
class Evidence:
    """Everything known about how one launch ended."""

    returncode: int
    result_status: Status | None = None  # rank 0's result.json status, if written
    last_words: list[LastWords] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)
    hang_detected: bool = False  # the supervisor killed it: heartbeats stopped advancing
    stop_requested: bool = False  # the supervisor stopped it on request (cancel/preempt)
    timed_out: bool = False  # the stage's time limit
    writes_result: bool = True  # False for a user's script: exit 0 is its only verdict
    world_size: int | None = None  # ranks in the group (None: unknown, e.g. a script)


@dataclass(frozen=True)
class Classification:
    cause: Cause | None  # None: completed
    retryable: bool
    detail: str
    # A stop the supervisor asked for ended a rank before its handler could write the emergency checkpoint.
    not_checkpointed: bool = False

    @property
    def completed(self) -> bool:
        return self.cause is None


def primary_words(words: list[LastWords]) -> list[LastWords]:
    """Last words that name a failure of their own, not an echo of a peer's."""
    return [w for w in sorted(words, key=lambda w: w.time) if normalize(w.cause) not in _ECHOES]


def lost_rank(words: list[LastWords], world_size: int | None) -> int | None:
    """A rank that left no last words while a peer's say it was preempted: that rank was killed, and the
    peers' SIGTERM was torchrun stopping the group after it. A preemption reaches every rank and each
    says so; whether a peer noticed the broken collective before torchrun's SIGTERM arrived is a race
    (a loaded machine loses it), so the silent rank decides, not which of the two came first.

    >>> lost_rank([LastWords(0, "preempted", "SIGTERM", 1.0, 75)], 2), lost_rank(
    ...     [LastWords(0, "preempted", "", 1.0, 75), LastWords(1, "preempted", "", 1.0, 75)], 2)
    (1, None)
    """
    if not world_size or not any(normalize(w.cause) == Cause.PREEMPTED for w in words):
        return None
    silent = sorted(set(range(world_size)) - {w.rank for w in words})
    return silent[0] if silent else None


def normalize(text: str | None) -> Cause:
    """A cause as last words name it, in the vocabulary (unknown words: a user error)."""
    try:
        cause = Cause(text or Cause.USER_ERROR)
    except ValueError:
        return Cause.USER_ERROR
    # The checkpoint store failing after in-process retries is a storage fault like any other.
    return Cause.TRANSIENT_IO if cause == Cause.CHECKPOINT_ERROR else cause


def classify(ev: Evidence, oom_retry: bool = False) -> Classification:
    """How a launch ended. ``oom_retry``: the OOM policy is on, so an OOM is worth a restart."""

    def out(cause: Cause, detail: str) -> Classification:
        return Classification(cause, cause in RETRYABLE or (cause == Cause.OOM and oom_retry), detail)

    finished = ev.result_status in (Status.COMPLETED, Status.STOPPED) if ev.writes_result else True
    if ev.returncode == 0 and finished:
        return Classification(None, False, str(ev.result_status or Status.COMPLETED))
    words = sorted(ev.last_words, key=lambda w: w.time)
    primary = primary_words(words)
    if ev.hang_detected and not primary:
        return out(Cause.HANG, "heartbeats stopped advancing; the tree was killed")
    if ev.result_status == Status.DIVERGED or ev.returncode == exitcodes.DIVERGED:
        return out(Cause.DIVERGED, "non-finite loss beyond optim.nonfinite_tolerance")
    if not ev.stop_requested and (lost := lost_rank(words, ev.world_size)) is not None:
        return out(Cause.WORKER_LOST, _LOST.format(rank=lost))
    # A rank's own error outranks a preemption nobody asked for: its peers' SIGTERM is the fallout.
    if primary and not (ev.stop_requested and normalize(primary[0].cause) == Cause.PREEMPTED):
        w = primary[0]
        return out(normalize(w.cause), f"rank {w.rank}: {w.error}")
    if ev.result_status == Status.PREEMPTED or ev.returncode == exitcodes.PREEMPTED:
        return out(Cause.PREEMPTED, "SIGTERM honoured, emergency checkpoint written")
    if ev.timed_out:
        return out(Cause.TIMEOUT, "the stage exceeded stages.<stage>.timeout_s")
    tail = "\n".join(ev.log_tail)
    root = tail[tail.find("Root Cause") :] if "Root Cause" in tail else tail  # torchrun's first observed failure
    signals = [int(s) for s in _TORCHRUN_SIGNAL.findall(root) or _TORCHRUN_SIGNAL.findall(tail)]
    if ev.returncode < 0:
        signals.append(-ev.returncode)
    if signals and ev.stop_requested and set(signals) <= _STOP_SIGNALS:
        # The supervisor's own stop (SIGTERM, SIGKILL after the grace) ended a rank before its handler
        # could checkpoint (a rank still starting up): the stop asked for, not a lost worker.
        detail = f"{NOT_CHECKPOINTED}: a rank ended by signal {signals[0]} ({_signame(signals[0])})"
        return replace(out(Cause.PREEMPTED, detail), not_checkpointed=True)
    if signals:
        return out(Cause.WORKER_LOST, f"a rank was killed by signal {signals[0]} ({_signame(signals[0])})")
    if not ev.writes_result and ev.returncode > 0:
        # A user's script that exits non-zero on its own raised an error: a bug, not a lost worker.
        return out(Cause.USER_ERROR, f"the script exited with code {ev.returncode}")
    if words:
        return out(Cause.WORKER_LOST, f"rank {words[0].rank}: {words[0].error}")
    if ev.stop_requested:
        return out(Cause.PREEMPTED, "stopped on request")
    if ev.returncode == exitcodes.USER_ERROR:
        return out(Cause.USER_ERROR, "exit code 64 (bad config or recipe error)")
    if ev.returncode == exitcodes.TRANSIENT_IO:
        return out(Cause.TRANSIENT_IO, "exit code 77 (storage or network)")
    if ev.returncode == exitcodes.DISK_FULL:
        return out(Cause.DISK_FULL, "exit code 78 (a disk is full)")
    # An unexplained non-zero exit with no last words: a crash we did not see. One that repeats
    # is stopped by the retry budget; treating it as a bug would give up on a flaky node at once.
    return out(Cause.WORKER_LOST, f"exit code {ev.returncode} without last words")


def restarted_in_place(words: list[LastWords], world_size: int | None) -> tuple[Cause, str]:
    """Why torchrun restarted a group in place: (cause, detail) from the replaced incarnation's last words."""
    if (lost := lost_rank(words, world_size)) is not None:
        return Cause.WORKER_LOST, _LOST.format(rank=lost)
    primary = primary_words(words)
    if primary:
        return normalize(primary[0].cause), f"rank {primary[0].rank}: {primary[0].error}"
    return Cause.WORKER_LOST, "a worker failed"


def fatal_for_inplace(words: list[LastWords], result_status: Status | None) -> Cause | None:
    """A failure, seen while the tree still runs, that torchrun must not answer with an in-place restart."""
    if result_status == Status.DIVERGED:
        return Cause.DIVERGED
    for w in primary_words(words):
        if normalize(w.cause) not in INPLACE_OK:
            return normalize(w.cause)
    return None


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "unknown"
