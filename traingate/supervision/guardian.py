"""A guardian: when the orchestrator process dies, nothing it started outlives it.

``traingate run`` starts a temporary Prefect server and process trees (torchrun, its workers)
that live in sessions of their own: a SIGKILLed CLI leaves them running unsupervised. The
guardian is a tiny separate process (``python -m traingate.supervision.guardian PID GRACE``)
that remembers the orchestrator's descendants every half second; once the orchestrator is
gone it sends them SIGTERM (training ranks write their emergency checkpoint, torchrun stops
its group, the server shuts down), waits ``GRACE`` seconds, and SIGKILLs what is left.
psutil compares start times, so a recycled pid is never signalled. The descendants are read from
``/proc/PID/task/*/children`` (what Linux records of each process's children), so one look costs what the
orchestrator's tree holds, not a read of every process on the machine as a parent-pid scan does; where
the kernel does not provide that file, psutil's scan is used.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
_PROC_CHILDREN = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


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


def descendant_pids(pid: int) -> set[int]:
    """The pids of ``pid``'s descendants, from the kernel's per-thread child lists (a process whose parent
    exits is the init process's or a subreaper's from then on, and is not listed, as with a parent-pid scan).

    >>> child = subprocess.Popen(["sleep", "5"])
    >>> child.pid in descendant_pids(os.getpid())
    True
    >>> child.kill(); child.wait()
    -9
    """
    if not _PROC_CHILDREN:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # gone meanwhile
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children", "rb") as f:
                    kids = f.read().split()
            except OSError:
                continue
            for kid in map(int, kids):
                if kid not in found:
                    found.add(kid)
                    todo.append(kid)
    return found


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
            for child in descendant_pids(pid) - seen.keys() - {me}:
                try:
                    seen[child] = psutil.Process(child)  # its start time, so a recycled pid is never signalled
                except psutil.NoSuchProcess:
                    pass
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
