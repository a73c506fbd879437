"""Fence a trial's orphaned training processes before its re-queued successor starts.

When a sweep's driver dies, the trainers it started live on in their own sessions. The
re-queued trial trains into the same stage dir and checkpoint location, so any process
still writing there must stop first. The heartbeat files name their pids.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil

_MARK = "traingate.runtime.train"


def orphans(stage_dir: Path) -> list[int]:
    """Pids of live training processes that last wrote a heartbeat into ``stage_dir``."""
    pids = []
    for hb in sorted(stage_dir.glob("heartbeat.rank*.json")):
        try:
            pid = int(json.loads(hb.read_text())["pid"])
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and any(_MARK in part for part in proc.cmdline()):
                pids.append(pid)
        except (ValueError, KeyError, OSError, psutil.Error):
            continue  # half-written heartbeat or a process already gone: nothing to fence
    return pids


def fence(stage_dir: Path, grace_s: float = 15.0) -> list[int]:
    """SIGTERM the process groups of orphaned trainers (they checkpoint and exit), SIGKILL after grace."""
    pids = orphans(stage_dir)
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    for g in groups:
        try:
            os.killpg(g, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and orphans(stage_dir):
        time.sleep(0.2)
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids
