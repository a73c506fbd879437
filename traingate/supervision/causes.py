"""Why a training process tree ended, and whether a restart can help.

Evidence, strongest first: what the supervisor itself did (killed a hung tree,
stopped it on request), ``result.json`` (rank 0's own verdict), the ranks' last
words, a rank killed by a signal (from torchrun's failure summary or our own exit
status), and finally the exit code.

>>> classify(Evidence(returncode=-9)).cause
'worker_lost'
>>> c = classify(Evidence(returncode=1, last_words=[{"cause": "user_error", "error": "KeyError: 'x'"}]))
>>> c.cause, c.retryable
('user_error', False)
"""
from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from typing import Any

from traingate.runtime import exitcodes

PREEMPTED = "preempted"
WORKER_LOST = "worker_lost"
HANG = "hang"
COLLECTIVE_TIMEOUT = "collective_timeout"
TRANSIENT_IO = "transient_io"
OOM = "oom"
DIVERGED = "diverged"
USER_ERROR = "user_error"
TIMEOUT = "timeout"  # the stage's own time limit: retrying would only exceed it again
CAUSES = (PREEMPTED, WORKER_LOST, HANG, COLLECTIVE_TIMEOUT, TRANSIENT_IO, OOM, DIVERGED, USER_ERROR, TIMEOUT)

# A restart from the latest checkpoint can fix these; it cannot fix a bad config, a bug or NaN math.
# OOM is retryable only under the opt-in OOM policy (see traingate.supervision.oom).
RETRYABLE = frozenset({PREEMPTED, WORKER_LOST, HANG, COLLECTIVE_TIMEOUT, TRANSIENT_IO})

# Errors from the collective layer that mean "a peer went away" rather than "a peer is slow".
_PEER_LOST = re.compile(r"connection (closed|reset) by peer|broken pipe|socket closed|peer.*(closed|disconnect)"
                        r"|connection refused|ncclRemoteError|remote process exited", re.I)
_TIMED_OUT = re.compile(r"timed? ?out|timeout|watchdog caught collective", re.I)
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
                     errno.EISDIR, errno.ENOTDIR}
# torchrun's failure summary: "exitcode  : -9 (pid: 123)" for a worker killed by SIGKILL.
_TORCHRUN_SIGNAL = re.compile(r"exitcode\s*:\s*-(\d+)")
# Last-words causes that are only an echo of another rank's failure.
_ECHOES = {WORKER_LOST}


def _is_collective_error(e: BaseException) -> bool:
    import torch.distributed as dist

    text = str(e).lower()
    return isinstance(e, getattr(dist, "DistError", ())) or "gloo" in text or "nccl" in text or "processgroup" in text


def cause_of_exception(e: BaseException) -> str:
    """The cause a training process reports for an exception it caught (in its last words)."""
    import torch

    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return OOM
    if _is_collective_error(e):
        if _TIMED_OUT.search(str(e)) and not _PEER_LOST.search(str(e)):
            return COLLECTIVE_TIMEOUT
        return WORKER_LOST  # a peer died; its own exit tells why
    if isinstance(e, (ConnectionError, TimeoutError)):
        return TRANSIENT_IO
    if isinstance(e, OSError) and e.errno not in _PERMANENT_ERRNOS:
        return TRANSIENT_IO
    return USER_ERROR


def exit_code_for(cause: str) -> int:
    return {USER_ERROR: exitcodes.USER_ERROR, TRANSIENT_IO: exitcodes.TRANSIENT_IO,
            DIVERGED: exitcodes.DIVERGED, PREEMPTED: exitcodes.PREEMPTED}.get(cause, 1)


@dataclass
class Evidence:
    """Everything known about how one launch ended."""
    returncode: int
    result_status: str | None = None       # rank 0's result.json status, if written
    last_words: list[dict[str, Any]] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)
    hang_detected: bool = False            # the supervisor killed it: heartbeats stopped advancing
    stop_requested: bool = False           # the supervisor stopped it on request (cancel/preempt)
    timed_out: bool = False                # the stage's time limit


@dataclass(frozen=True)
class Classification:
    cause: str | None  # None: completed
    retryable: bool
    detail: str

    @property
    def completed(self) -> bool:
        return self.cause is None


def classify(ev: Evidence, oom_retry: bool = False) -> Classification:
    """How a launch ended. ``oom_retry``: the OOM policy is on, so an OOM is worth a restart."""
    def out(cause: str, detail: str) -> Classification:
        return Classification(cause, cause in RETRYABLE or (cause == OOM and oom_retry), detail)

    if ev.returncode == 0 and ev.result_status == "completed":
        return Classification(None, False, "completed")
    words = sorted(ev.last_words, key=lambda w: w.get("time", 0.0))
    primary = [w for w in words if w.get("cause") not in _ECHOES]
    if ev.hang_detected and not primary:
        return out(HANG, "heartbeats stopped advancing; the tree was killed")
    if ev.result_status == exitcodes.NAMES[exitcodes.DIVERGED] or ev.returncode == exitcodes.DIVERGED:
        return out(DIVERGED, "non-finite loss beyond optim.nonfinite_tolerance")
    if ev.result_status == "preempted" or ev.returncode == exitcodes.PREEMPTED:
        return out(PREEMPTED, "SIGTERM honoured, emergency checkpoint written")
    if primary:
        w = primary[0]
        cause = w.get("cause") or USER_ERROR
        cause = TRANSIENT_IO if cause == "checkpoint_error" else cause
        cause = cause if cause in CAUSES else USER_ERROR
        return out(cause, f"rank {w.get('rank', '?')}: {w.get('error')}")
    if ev.timed_out:
        return out(TIMEOUT, "the stage exceeded stages.<stage>.timeout_s")
    tail = "\n".join(ev.log_tail)
    root = tail[tail.find("Root Cause"):] if "Root Cause" in tail else tail  # torchrun's first observed failure
    signals = [int(s) for s in _TORCHRUN_SIGNAL.findall(root) or _TORCHRUN_SIGNAL.findall(tail)]
    if ev.returncode < 0:
        signals.append(-ev.returncode)
    if signals:
        return out(WORKER_LOST, f"a rank was killed by signal {signals[0]} ({_signame(signals[0])})")
    if words:
        return out(WORKER_LOST, f"rank {words[0].get('rank', '?')}: {words[0].get('error')}")
    if ev.stop_requested:
        return out(PREEMPTED, "stopped on request")
    if ev.returncode == exitcodes.USER_ERROR:
        return out(USER_ERROR, "exit code 64 (bad config or recipe error)")
    if ev.returncode == exitcodes.TRANSIENT_IO:
        return out(TRANSIENT_IO, "exit code 77 (storage or network)")
    # An unexplained non-zero exit with no last words: a crash we did not see. One that repeats
    # is stopped by the retry budget; treating it as a bug would give up on a flaky node at once.
    return out(WORKER_LOST, f"exit code {ev.returncode} without last words")


def _signame(sig: int) -> str:
    import signal

    try:
        return signal.Signals(sig).name
    except ValueError:
        return "unknown"
