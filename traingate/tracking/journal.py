"""A write-ahead journal of tracking records, one JSON object per line, in the stage directory.

Every record a training process logs is appended here first (a local file append,
no network), then delivered to MLflow by the writer thread, which commits the byte
offset it has delivered up to. So the backlog during a tracking outage lives on
disk, not in memory; a process killed mid-run leaves its undelivered records for
the next process of the same stage to replay; and the journal remembers which
steps were already logged, so a resumed process never logs a step twice.

Record kinds: ``{"m": key, "v": value, "s": step, "t": ms}`` (metric),
``{"tag": key, "v": value}`` (tag), ``{"session": n, ...}`` and ``{"end": status, ...}``
(process lifetimes; kept local, never delivered).

A run has journals in two places (:func:`journals_of`): each stage's, written by its rank 0,
and the run's own (``<run dir>/tracking/journal.jsonl``), where the orchestrator keeps the
MLflow writes it could not make while the tracking store was gone (``{"call": name,
"args": {...}}`` records, see :mod:`traingate.tracking.runs`). ``traingate replay`` delivers both.

>>> import tempfile, pathlib
>>> j = Journal(pathlib.Path(tempfile.mkdtemp()) / "journal.jsonl")
>>> j.append([{"m": "loss", "v": 1.0, "s": 1, "t": 0}])
>>> [(record, end)] = j.read_pending(100)
>>> record["m"], j.commit(end), j.read_pending(100)
('loss', None, [])
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class History:
    """What earlier processes of this stage left in the journal."""

    high_water: dict[str, int] = field(default_factory=dict)  # metric key -> highest step logged
    sessions: list[dict[str, Any]] = field(default_factory=list)
    ended: dict[str, Any] | None = None  # the last session's end record, if it ended cleanly
    last_time_ms: int | None = None  # the newest record's timestamp: the previous process's last sign of life
    step_times_ms: dict[int, int] = field(default_factory=dict)  # step -> when it was first logged


JOURNAL = "journal.jsonl"
TRACKING_DIR = "tracking"


def journal_path(run_or_stage_dir: Path) -> Path:
    """Where a stage's (or, for a run directory, the orchestrator's) journal lives."""
    return Path(run_or_stage_dir) / TRACKING_DIR / JOURNAL


def pending_bytes(path: Path) -> int:
    """Bytes of a journal not delivered yet (0 when there is no journal), without opening it for writing."""
    try:
        size = Path(path).stat().st_size
    except FileNotFoundError:
        return 0
    try:
        delivered = int(Path(str(path) + ".delivered").read_text().strip() or 0)
    except FileNotFoundError:
        delivered = 0
    return max(0, size - delivered)


def journals_of(run_dir: Path) -> list[Path]:
    """A run's stage journals (sorted by stage directory), then its orchestrator journal: existing ones only."""
    stages = sorted(p for p in Path(run_dir).glob(f"*/{TRACKING_DIR}/{JOURNAL}"))
    own = journal_path(run_dir)
    return [*stages, *([own] if own.exists() else [])]


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.offset_path = self.path.with_name(self.path.name + ".delivered")
        self._repair()
        self._lock = threading.Lock()
        self._out = open(self.path, "a", encoding="utf-8")

    def _repair(self) -> None:
        """Cut a torn last line (a process killed mid-append) so later appends start on a fresh line."""
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append records durably enough to survive SIGKILL (the page cache outlives the process)."""
        blob = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        with self._lock:
            self._out.write(blob)
            self._out.flush()

    def delivered_offset(self) -> int:
        try:
            return int(self.offset_path.read_text().strip() or 0)
        except FileNotFoundError:
            return 0

    def read_pending(self, max_records: int) -> list[tuple[dict[str, Any], int]]:
        """Undelivered records in order (complete lines only), each with the offset just after it."""
        out: list[tuple[dict[str, Any], int]] = []
        end = self.delivered_offset()
        with open(self.path, "rb") as f:
            f.seek(end)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # being written right now; the next read gets it whole
                end += len(line)
                out.append((json.loads(line), end))
                if len(out) >= max_records:
                    break
        return out

    def commit(self, offset: int) -> None:
        tmp = self.offset_path.with_name(self.offset_path.name + ".tmp")
        tmp.write_text(str(offset))
        os.replace(tmp, self.offset_path)

    def pending_bytes(self) -> int:
        return self.path.stat().st_size - self.delivered_offset()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def history(self) -> History:
        h = History()
        with open(self.path, "rb") as f:
            for line in f:
                r = json.loads(line)
                if "m" in r:
                    key, step = r["m"], r["s"]
                    if step > h.high_water.get(key, -1):
                        h.high_water[key] = step
                    h.step_times_ms.setdefault(step, r["t"])
                    h.last_time_ms = r["t"]
                elif "session" in r:
                    h.sessions.append(r)
                    h.ended = None
                    h.last_time_ms = r["t"]
                elif "end" in r:
                    h.ended = r
                    h.last_time_ms = r["t"]
        return h

    def close(self) -> None:
        with self._lock:
            self._out.close()
