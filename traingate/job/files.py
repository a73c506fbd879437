"""The files of a stage directory: one typed reader and writer each, side by side.

    job.json                  the StageJob of the current attempt (orchestrator -> training process)
    heartbeat.rank<r>.json    each rank, every step (training process -> supervisor)
    last_words.rank<r>.json   a rank that caught an error, just before it exits
    result.json               rank 0's verdict and metrics when the process ends
    progress.jsonl            intermediate validation, one line per evaluation (sweeps prune on it)
    supervisor.json           the supervisor's attempts and final verdict (for `traingate resume`)

Writes are atomic (temporary file + rename): a reader sees the old file or the new one,
never half of one. A file that is missing or unreadable reads as None / empty: it is
being replaced, or its writer was killed mid-write, and the next poll sees it.

>>> import tempfile; d = Path(tempfile.mkdtemp())
>>> write_heartbeat(d, Heartbeat(rank=1, step=7, time=1.0, pid=42))
>>> read_heartbeats(d)[1].step
7
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from traingate.job.vocab import Status
from traingate.redact import redact_tree

JOB = "job.json"
RESULT = "result.json"
PROGRESS = "progress.jsonl"
SUPERVISOR = "supervisor.json"
STDOUT = "stdout.log"
# Written anew by every launch: a launch must not be judged by its predecessor's heartbeats or verdict.
PER_LAUNCH = ("heartbeat.rank*.json", "last_words.rank*.json", RESULT)
_RANK = re.compile(r"\.rank(\d+)(?:\.restart\d+)?\.json$")


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _build(cls: type, data: Any) -> Any:
    """A dataclass from a dict, ignoring keys it does not know (files outlive code versions)."""
    if not isinstance(data, dict):
        return None
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


# ---------------------------------------------------------------- heartbeats

@dataclass
class Heartbeat:
    rank: int
    step: int
    time: float
    pid: int
    start_step: int = 0
    first_step_time: float | None = None   # this launch's first completed step (time to recovery ends here)
    phase: str = "train"                   # train | preempting | finishing: outside "train" slow is not hung
    restart_count: int = 0                 # torchrun's in-place restarts of the worker group
    # When this process started, finished its imports, joined the group and loaded its checkpoint
    # (epoch seconds): where a restart's time goes.
    timeline: dict[str, float] = field(default_factory=dict)


def write_heartbeat(stage_dir: Path, hb: Heartbeat) -> None:
    write_json(stage_dir / f"heartbeat.rank{hb.rank}.json", asdict(hb))


def _ranked(stage_dir: Path, prefix: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for p in stage_dir.glob(f"{prefix}.rank*.json"):
        m = _RANK.search(p.name)
        data = read_json(p) if m else None
        if isinstance(data, dict):
            yield int(m.group(1)), {**data, "rank": int(m.group(1))}


def read_heartbeats(stage_dir: Path) -> dict[int, Heartbeat]:
    return {r: hb for r, d in _ranked(stage_dir, "heartbeat") if (hb := _build(Heartbeat, d)) is not None}


# ---------------------------------------------------------------- last words

@dataclass
class LastWords:
    rank: int
    cause: str
    error: str
    time: float
    exit_code: int
    traceback: str = ""
    restart_count: int = 0   # the group incarnation that said them (torchrun's in-place restarts)


def write_last_words(stage_dir: Path, words: LastWords) -> None:
    # One file per rank and incarnation: a group restarted in place must not overwrite why the one
    # before it ended (a peer's echo of the next failure would replace the cause of this one).
    suffix = f".restart{words.restart_count}" if words.restart_count else ""
    write_json(stage_dir / f"last_words.rank{words.rank}{suffix}.json", redact_tree(asdict(words)))


def read_last_words(stage_dir: Path, restart_count: int | None = None) -> list[LastWords]:
    """Every rank's last words, oldest first; only one incarnation's with ``restart_count``."""
    words = [w for _, d in _ranked(stage_dir, "last_words") if (w := _build(LastWords, d)) is not None]
    return sorted((w for w in words if restart_count is None or w.restart_count == restart_count),
                  key=lambda w: w.time)


# ---------------------------------------------------------------- result

@dataclass
class RuntimeResult:
    """What rank 0 leaves when the training process ends on its own."""
    status: Status
    exit_code: int
    steps_done: int = 0
    resumed_from_step: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint_uri: str | None = None
    last_checkpoint_step: int | None = None
    checkpoint_blocked_s: float = 0.0

    def __post_init__(self) -> None:
        self.status = Status(self.status)


def write_result(stage_dir: Path, result: RuntimeResult) -> None:
    write_json(stage_dir / RESULT, redact_tree(asdict(result)))


def read_result(stage_dir: Path) -> RuntimeResult | None:
    return _build(RuntimeResult, read_json(stage_dir / RESULT))


def clear_launch_files(stage_dir: Path) -> None:
    for pattern in PER_LAUNCH:
        for p in stage_dir.glob(pattern):
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------- progress

def append_progress(stage_dir: Path, record: dict[str, Any]) -> None:
    """One evaluation: ``{step, time, val_loss, ...}``. Appended whole, so a reader never sees half a line."""
    with open(stage_dir / PROGRESS, "a") as f:
        f.write(json.dumps(record) + "\n")


class ProgressFollower:
    """Reads the lines a running trainer appends to progress.jsonl, each once."""

    def __init__(self, stage_dir: Path):
        self.path, self.offset = stage_dir / PROGRESS, 0

    def new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a half-written last line waits for the next call
        self.offset += len(complete)
        return [json.loads(line) for line in complete.decode().splitlines() if line.strip()]


# ---------------------------------------------------------------- supervisor state

@dataclass
class SupervisorState:
    """What the supervisor records about a stage; ``final`` is None while it runs (or if it died)."""
    job: dict[str, Any] = field(default_factory=dict)       # identity of the stage: run_id, stage, mlflow_run_id
    attempts: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] | None = None
    supervisor_pid: int | None = None

    @property
    def final_status(self) -> Status | None:
        return Status(self.final["status"]) if self.final and self.final.get("status") else None


def write_supervisor_state(stage_dir: Path, state: SupervisorState) -> None:
    write_json(stage_dir / SUPERVISOR, redact_tree(asdict(state)))


def read_supervisor_state(stage_dir: Path) -> SupervisorState | None:
    return _build(SupervisorState, read_json(stage_dir / SUPERVISOR))
