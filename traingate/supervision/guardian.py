"""A guardian: when the orchestrator process dies, nothing it started outlives it.

``traingate run`` starts a temporary Prefect server and process trees (torchrun, its workers)
that live in sessions of their own: a SIGKILLed CLI leaves them running unsupervised. The
guardian is a tiny separate process (``python -m traingate.supervision.guardian PID GRACE``)
that remembers the orchestrator's descendants every half second; once the orchestrator is
gone it sends them SIGTERM (training ranks write their emergency checkpoint, torchrun stops
its group, the server shuts down), waits ``GRACE`` seconds, and SIGKILLs what is left.
psutil compares start times, so a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.5


def start(grace_s: float, pid: int | None = None) -> subprocess.Popen:
    """Start a guardian for ``pid`` (default: this process)."""
    return subprocess.Popen(
        [sys.executable, "-m", "traingate.supervision.guardian", str(pid or os.getpid()), str(grace_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


_started: list[subprocess.Popen] = []


def ensure(grace_s: float) -> subprocess.Popen:
    """This process's guardian, started on first use (one per process, however many commands it runs)."""
    if not _started or _started[0].poll() is not None:
        _started[:] = [start(grace_s)]
    return _started[0]


def is_guardian(p: psutil.Process) -> bool:
    """Whether ``p`` is a guardian (it outlives the commands of the process it guards, by design)."""
    try:
        return "traingate.supervision.guardian" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def guard(pid: int, grace_s: float, poll_s: float = POLL_S) -> int:
    """Watch ``pid``; return how many of its descendants had to be stopped after it died."""
    try:
        owner = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return 0
    seen: dict[int, psutil.Process] = {}
    me = os.getpid()
    while True:
        try:
            if owner.status() == psutil.STATUS_ZOMBIE:
                break
            # A new session changes nothing about parentage: torchrun's workers are found through torchrun.
            for child in owner.children(recursive=True):
                if child.pid != me:
                    seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        seen = {pid: p for pid, p in seen.items() if p.is_running()}
        time.sleep(poll_s)
    alive = [p for p in seen.values() if p.is_running()]
    for p in alive:
        _signal(p, signal.SIGTERM)
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        _signal(p, signal.SIGKILL)
    return len(alive)


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass  # gone on its own


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the CLI is not for its guardian
    guard(int(sys.argv[1]), float(sys.argv[2]))
