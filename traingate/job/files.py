"""The files of a stage directory: one typed reader and writer each, side by side.

    job.json                  the StageJob of the current attempt (orchestrator -> training process)
    heartbeat.rank<r>.json    each rank, every step (training process -> supervisor)
    last_words.rank<r>.json   a rank that caught an error, just before it exits
    result.json               rank 0's verdict and metrics when the process ends
    progress.jsonl            intermediate validation, one line per evaluation (sweeps prune on it)
    metrics.jsonl             rank 0, one line per step: loss, gradient norm, lr, step and data-wait time
    alerts.jsonl              the supervisor's monitor: one line per alert that fired, and what was done
    supervisor.json           the supervisor's attempts and final verdict (for `traingate resume`)
    charged.json              the stage's attempts as the ledger charged them (what `traingate watch` adds up)

and one file of the run directory:

    logbook.jsonl             what happened to the run, one line per event (alerts, actions, roll-backs)

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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from traingate.job.vocab import Status
from traingate.redact import redact_tree

JOB = "job.json"
RESULT = "result.json"
PROGRESS = "progress.jsonl"
METRICS = "metrics.jsonl"
SCRIPT_METRICS = "script_metrics.jsonl"  # a script's metric points, read from its output as it ran (all attempts)
SCRIPT_TOTAL = "script_total.json"  # the step total a script reports in its output (a `total` group)
ALERTS = "alerts.jsonl"
LOGBOOK = "logbook.jsonl"
SUPERVISOR = "supervisor.json"
CHARGED = "charged.json"
STDOUT = "stdout.log"
# The supervisor stops this launch on purpose (written before the SIGTERM): its agent shuts the group
# down instead of restarting it in place as after a preemption (traingate.runtime.agent).
STOP = "stop.json"
# Written anew by every launch: a launch must not be judged by its predecessor's heartbeats or verdict.
PER_LAUNCH = ("heartbeat.rank*.json", "last_words.rank*.json", RESULT, STOP)
_RANK = re.compile(r"\.rank(\d+)(?:\.restart\d+)?\.json$")


def write_json(path: Path, data: Any, sync: bool = False) -> None:
    """Write ``data`` as JSON to ``path`` atomically; ``sync``: on disk before it returns (fsync of the
    file and its directory), for a record that must survive the machine, not only the process."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1, sort_keys=True, default=str))
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
    first_step_time: float | None = None  # this launch's first completed step (time to recovery ends here)
    phase: str = "train"  # train | preempting | finishing: outside "train" slow is not hung
    restart_count: int = 0  # torchrun's in-place restarts of the worker group
    step_time_s: float | None = None  # this rank's last step
    data_wait_s: float | None = None  # of which waiting for its batch
    # [step, busy seconds] of this rank's last steps: its own work before the step's first collective
    # (synchronous data parallelism evens out whole step times; a straggler shows in this).
    recent: list[list[float]] = field(default_factory=list)
    # When this process started, finished its imports, joined the group and loaded its checkpoint
    # (epoch seconds): where a restart's time goes.
    timeline: dict[str, float] = field(default_factory=dict)


def write_heartbeat(stage_dir: Path, hb: Heartbeat) -> None:
    write_json(stage_dir / f"heartbeat.rank{hb.rank}.json", asdict(hb))


def _ranked(stage_dir: Path, prefix: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for p in stage_dir.glob(f"{prefix}.rank*.json"):
        m = _RANK.search(p.name)
        data = read_json(p) if m else None
        if m is not None and isinstance(data, dict):
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
    restart_count: int = 0  # the group incarnation that said them (torchrun's in-place restarts)


def write_last_words(stage_dir: Path, words: LastWords) -> None:
    # One file per rank and incarnation: a group restarted in place must not overwrite why the one
    # before it ended (a peer's echo of the next failure would replace the cause of this one).
    suffix = f".restart{words.restart_count}" if words.restart_count else ""
    write_json(stage_dir / f"last_words.rank{words.rank}{suffix}.json", redact_tree(asdict(words)))


def read_last_words(stage_dir: Path, restart_count: int | None = None) -> list[LastWords]:
    """Every rank's last words, oldest first; only one incarnation's with ``restart_count``."""
    words = [w for _, d in _ranked(stage_dir, "last_words") if (w := _build(LastWords, d)) is not None]
    return sorted((w for w in words if restart_count is None or w.restart_count == restart_count), key=lambda w: w.time)


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


def write_stop(stage_dir: Path, reason: str) -> None:
    write_json(stage_dir / STOP, {"reason": reason})


def claim_stop(stage_dir: Path, reason: str) -> bool:
    """Mark the launch stopped unless it already is; whether this call marked it.

    For the ranks of a group that fail at once: the first to claim the mark is the one that stops the
    agent, so the agent gets one SIGTERM, not one per rank (a second would interrupt its shutdown).
    """
    tmp = stage_dir / f".{STOP}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"reason": reason}))
    try:
        os.link(tmp, stage_dir / STOP)  # fails if the mark exists: exclusive, and whole when it appears
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def read_stop(stage_dir: Path) -> str | None:
    """Why the supervisor stops the current launch, or None when it does not."""
    data = read_json(stage_dir / STOP)
    return str(data.get("reason") or "stopped") if isinstance(data, dict) else None


def clear_launch_files(stage_dir: Path) -> None:
    for pattern in PER_LAUNCH:
        for p in stage_dir.glob(pattern):
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------- progress, metrics, alerts, logbook


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


@dataclass
class ScriptPoint:
    """One metric value a script printed, as the supervisor read it: the step its regex named (a running
    count per metric when it names none), and when the line arrived (a script prints no clock of its own)."""

    name: str
    step: int
    value: float
    time: float
    attempt: int


def append_script_points(stage_dir: Path, points: list[ScriptPoint]) -> None:
    with open(stage_dir / SCRIPT_METRICS, "a") as f:
        f.write("".join(json.dumps(asdict(p)) + "\n" for p in points))


def read_script_points(stage_dir: Path) -> list[ScriptPoint]:
    return [p for d in _read_lines(stage_dir / SCRIPT_METRICS) if (p := _build(ScriptPoint, d)) is not None]


def write_script_total(stage_dir: Path, total: int) -> None:
    write_json(stage_dir / SCRIPT_TOTAL, {"total": total})


def read_script_total(stage_dir: Path) -> int | None:
    """The step total the stage's script last reported (None: it reports none)."""
    d = read_json(stage_dir / SCRIPT_TOTAL)
    total = d.get("total") if isinstance(d, dict) else None
    return total if isinstance(total, int) and total > 0 else None


def append_progress(stage_dir: Path, record: dict[str, Any]) -> None:
    """One evaluation: ``{step, time, val_loss, ...}``. Appended whole, so a reader never sees half a line."""
    _append(stage_dir / PROGRESS, record)


@dataclass
class StepMetrics:
    """One training step as rank 0 saw it (the global loss; rank 0's own times)."""

    step: int
    time: float
    loss: float  # NaN/inf stay as written: the non-finite rule needs them
    grad_norm: float
    lr: float
    step_time_s: float
    data_wait_s: float
    attempt: int = 0
    gpu_util_percent: float | None = None  # at logging steps, where NVML sees a GPU


class MetricsWriter:
    """metrics.jsonl, appended by rank 0 each step. Buffered: the supervisor reads it about once a
    second, so a line costs a string format and no system call; ``flush`` at most every
    ``flush_s`` seconds and always at the end. A killed rank loses at most that much of the file."""

    def __init__(self, stage_dir: Path, flush_s: float = 0.5):
        self.f = open(stage_dir / METRICS, "a", buffering=1 << 16)
        self.flush_s, self.flushed = flush_s, 0.0

    def write(self, m: StepMetrics) -> None:
        self.f.write(json.dumps(asdict(m)) + "\n")
        if m.time - self.flushed >= self.flush_s:
            self.f.flush()
            self.flushed = m.time

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()


@dataclass
class AlertRecord:
    """An alert that fired in a stage, and what the supervisor did about it."""

    time: float
    stage: str
    rule: str
    severity: str
    action: str
    at: float  # the step (or epoch seconds) at which the condition first held
    message: str  # one line, naming the runbook section
    attempt: int = 0
    outcome: str = ""  # what was done: "notified", "paused", "rolled back to step 40", ...
    values: dict[str, float] = field(default_factory=dict)


def append_alert(stage_dir: Path, alert: AlertRecord) -> None:
    _append(stage_dir / ALERTS, redact_tree(asdict(alert)))


def read_alerts(stage_dir: Path) -> list[AlertRecord]:
    return [a for d in _read_lines(stage_dir / ALERTS) if (a := _build(AlertRecord, d)) is not None]


@dataclass
class LogbookEntry:
    """One line of the run's logbook: what happened, where, and why (the OPT-175B logbook, kept for you)."""

    time: float
    stage: str
    kind: str  # alert | rollback | pause | stop | quarantine | restart | budget
    text: str
    data: dict[str, Any] = field(default_factory=dict)


def append_logbook(run_dir: Path, entry: LogbookEntry) -> None:
    _append(run_dir / LOGBOOK, redact_tree(asdict(entry)))


def read_logbook(run_dir: Path) -> list[LogbookEntry]:
    return [e for d in _read_lines(run_dir / LOGBOOK) if (e := _build(LogbookEntry, d)) is not None]


def read_metrics(stage_dir: Path) -> list[StepMetrics]:
    return [m for d in _read_lines(stage_dir / METRICS) if (m := _build(StepMetrics, d)) is not None]


def _read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


class Follower:
    """Reads the lines a running writer appends to a JSON-lines file, each once."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a half-written last line waits for the next call
        self.offset += len(complete)
        return [json.loads(line) for line in complete.decode().splitlines() if line.strip()]


class ProgressFollower(Follower):
    """The evaluations a running trainer appends to progress.jsonl, each once."""

    def __init__(self, stage_dir: Path):
        super().__init__(stage_dir / PROGRESS)


# ---------------------------------------------------------------- supervisor state


@dataclass
class SupervisorState:
    """What the supervisor records about a stage; ``final`` is None while it runs (or if it died)."""

    job: dict[str, Any] = field(default_factory=dict)  # identity of the stage: run_id, stage, mlflow_run_id
    attempts: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] | None = None
    supervisor_pid: int | None = None

    @property
    def final_status(self) -> Status | None:
        return Status(self.final["status"]) if self.final and self.final.get("status") else None


def write_supervisor_state(stage_dir: Path, state: SupervisorState) -> None:
    # Synced: it holds the attempt about to launch (write-ahead), which `traingate resume` goes on from.
    write_json(stage_dir / SUPERVISOR, redact_tree(asdict(state)), sync=True)


def read_supervisor_state(stage_dir: Path) -> SupervisorState | None:
    return _build(SupervisorState, read_json(stage_dir / SUPERVISOR))


# ---------------------------------------------------------------- charged attempts


@dataclass
class Charged:
    """The stage's attempts as the ledger charged them (:meth:`traingate.cost.ledger.Attempt.to_record`).

    ``final``: written when the stage ended, by the task that recorded its StageResult (the same
    records; on a Slurm pool charged from sacct). Not final: attempts charged while the stage goes on
    that supervisor.json no longer holds (smoke's first half, once its second half runs).
    ``supervised``: how many attempts supervisor.json held when this was written; a later supervision
    of the stage (a resume) holds more, and then this final charge is no longer the whole stage.
    """

    final: bool = False
    attempts: list[dict[str, Any]] = field(default_factory=list)
    supervised: int = 0


def write_charged(stage_dir: Path, charged: Charged) -> None:
    write_json(stage_dir / CHARGED, asdict(charged))


def read_charged(stage_dir: Path) -> Charged | None:
    return _build(Charged, read_json(stage_dir / CHARGED))
