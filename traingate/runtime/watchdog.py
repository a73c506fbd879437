"""When a training process should stop at the next step: SIGTERM, or its supervisor is gone.

Training processes must never outlive their supervisor: a tree nobody watches burns its slots
to the end, and nobody records how it ended. Each rank watches the supervisor's pid (handed
over as ``TRAINGATE_SUPERVISOR_PID``); when it is gone, the rank stops as if preempted —
all ranks agree on the step, write the emergency checkpoint, and exit — so a later
``traingate resume`` loses nothing. psutil compares the process's start time too, so a
recycled pid does not pass for the supervisor.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import psutil

POLL_S = 0.5


class StopFlag:
    """Set by SIGTERM or by the supervisor's death; read once per step and agreed on by all ranks."""

    def __init__(self, supervisor_pid: int | None = None, poll_s: float = POLL_S):
        self.requested = False
        self.orphaned = False
        self.reason = "SIGTERM"
        signal.signal(signal.SIGTERM, self._handle)
        self._supervisor: psutil.Process | None = None
        if supervisor_pid is not None:
            try:
                self._supervisor = psutil.Process(supervisor_pid)
            except psutil.NoSuchProcess:
                self._orphan(supervisor_pid)  # gone before we started: do not train unwatched
                return
            threading.Thread(target=self._watch, args=(poll_s,), name="supervisor-watch", daemon=True).start()

    @staticmethod
    def orphaned_now(supervisor_pid: int | None) -> str | None:
        """Why this process has no supervisor right now, or None (no supervisor named: a process by hand)."""
        if supervisor_pid is None:
            return None
        try:
            p = psutil.Process(supervisor_pid)
            alive = p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        return None if alive else f"supervisor (pid {supervisor_pid}) is gone"

    def _orphan(self, pid: int) -> None:
        self.reason = f"supervisor (pid {pid}) is gone"
        self.orphaned = self.requested = True

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def _watch(self, poll_s: float) -> None:
        assert self._supervisor is not None
        done = threading.Event()
        while not done.wait(poll_s):
            try:
                alive = self._supervisor.is_running() and self._supervisor.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                self._orphan(self._supervisor.pid)
                return
