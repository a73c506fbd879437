"""How a training process names the error it caught (its last words) and the exit code it leaves.

The supervisor classifies a launch from these (traingate.supervision.causes); this half runs
inside the training process, so it lives with the runtime.

>>> import errno
>>> cause_of_exception(OSError(errno.ENOSPC, "No space left on device")), cause_of_exception(ValueError("bad"))
(<Cause.DISK_FULL: 'disk_full'>, <Cause.USER_ERROR: 'user_error'>)
>>> cause_of_exception(ValueError("[gloo] connection closed by peer"))
<Cause.WORKER_LOST: 'worker_lost'>
"""

from __future__ import annotations

import errno
import re

import torch
import torch.distributed as dist

from traingate.job.vocab import Cause
from traingate.runtime import exitcodes

# Errors from the collective layer that mean "a peer went away" rather than "a peer is slow".
PEER_LOST = re.compile(
    r"connection (closed|reset) by peer|broken pipe|socket closed|peer.*(closed|disconnect)"
    r"|connection refused|ncclRemoteError|remote process exited",
    re.I,
)
TIMED_OUT = re.compile(r"timed? ?out|timeout|watchdog caught collective", re.I)
_FULL = {errno.ENOSPC, errno.EDQUOT}
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.EISDIR, errno.ENOTDIR}


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return out


def _is_collective_error(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, getattr(dist, "DistError", ())) or "gloo" in text or "nccl" in text or "processgroup" in text


def cause_of_exception(e: BaseException) -> Cause:
    """The cause a training process reports for an exception it caught.

    Judged by what the error is, not by its Python type alone: a ``ValueError`` raised by a
    collective that lost its peer is a lost worker, not a bad config.
    """

    chain = _chain(e)
    if any(isinstance(x, OSError) and x.errno in _FULL for x in chain):
        return Cause.DISK_FULL
    if any(isinstance(x, (torch.OutOfMemoryError, MemoryError)) for x in chain):
        return Cause.OOM
    if _is_collective_error(e):
        if TIMED_OUT.search(str(e)) and not PEER_LOST.search(str(e)):
            return Cause.COLLECTIVE_TIMEOUT
        return Cause.WORKER_LOST  # a peer died; its own exit tells why
    if isinstance(e, (ConnectionError, TimeoutError)):
        return Cause.TRANSIENT_IO
    if isinstance(e, OSError) and e.errno not in _PERMANENT_ERRNOS:
        return Cause.TRANSIENT_IO
    return Cause.USER_ERROR


def exit_code_for(cause: Cause | str) -> int:
    return {
        Cause.USER_ERROR: exitcodes.USER_ERROR,
        Cause.TRANSIENT_IO: exitcodes.TRANSIENT_IO,
        Cause.CHECKPOINT_ERROR: exitcodes.TRANSIENT_IO,
        Cause.DIVERGED: exitcodes.DIVERGED,
        Cause.PREEMPTED: exitcodes.PREEMPTED,
        Cause.ORCHESTRATOR_LOST: exitcodes.PREEMPTED,
        Cause.DISK_FULL: exitcodes.DISK_FULL,
    }.get(Cause(cause), 1)
