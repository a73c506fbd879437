"""The live view of a run: a :class:`Snapshot` read from its run directory, and how it is drawn.

Everything comes from the files the stages write (:mod:`traingate.job.files`): ``job.json``
(steps, world, pool, slots, price), rank 0's ``metrics.jsonl`` (loss, times, GPU utilisation),
every rank's heartbeat, ``alerts.jsonl`` and ``supervisor.json`` (attempts: restarts, dollars,
the verdict). Nothing here talks to Prefect or MLflow: `traingate watch` works on any machine
that sees the state directory, while the run goes on or after it ended.

:class:`RunReader` follows the files incrementally (a long stage's metrics are read once);
:func:`render` draws a snapshot for an 80-column terminal with rich.

>>> sparkline([1, 2, 3, 4, 5, 6, 7, 8], width=8)
'▁▂▃▄▅▆▇█'
>>> sparkline([3.0, float("nan"), 1.0], width=3)
'█×▁'
>>> bar(0.5, 10)
'█████░░░░░'
"""

from __future__ import annotations

import math
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import yaml
from rich.console import Group
from rich.table import Table
from rich.text import Text

from traingate.cost import charged
from traingate.job import files
from traingate.job.vocab import Status
from traingate.tracking import restarts as restart_record
from traingate.tracking import stale
from traingate.units import duration, usd

STAGE_ORDER = ("unit", "smoke", "canary", "full")
TRAINING_STAGES = STAGE_ORDER[1:]
SPARK = "▁▂▃▄▅▆▇█"
NONFINITE = "×"
SPARK_WIDTH = 40
HISTORY = 2000  # metric lines of the watched stage kept for the sparklines
RATE_WINDOW = 30  # recent steps the rate (and so the ETA) is measured over
MAX_RANK_ROWS = 8  # a wide job shows its slowest ranks, not a screenful of them
EPOCH_FLOOR = 1e9  # an alert's ``at`` above this is a time (2001 on), below it a step
QUIET_S = 30.0  # no orchestrator to ask: finished stages and nothing written for this long


# ---------------------------------------------------------------- pure drawing helpers


def sparkline(values: Sequence[float], width: int = SPARK_WIDTH) -> str:
    """``values`` in at most ``width`` characters: means of equal buckets, scaled between their
    min and max; a bucket with a non-finite value is drawn as ``×`` (a NaN loss must show)."""
    if not values:
        return ""
    n = min(width, len(values))
    buckets: list[float] = []
    for i in range(n):
        chunk = values[i * len(values) // n : (i + 1) * len(values) // n]
        buckets.append(sum(chunk) / len(chunk) if all(math.isfinite(v) for v in chunk) else math.nan)
    finite = [v for v in buckets if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    span = hi - lo
    out = []
    for v in buckets:
        if not math.isfinite(v):
            out.append(NONFINITE)
        else:
            out.append(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK))) if span > 0 else 3])
    return "".join(out)


def bar(fraction: float, width: int) -> str:
    done = max(0, min(width, int(round(fraction * width))))
    return "█" * done + "░" * (width - done)


# ---------------------------------------------------------------- the snapshot


@dataclass(frozen=True)
class StageLine:
    """One stage of the run as its files say: ``status`` is a :class:`Status` value, ``running``,
    or ``waiting`` (directory made, nothing launched yet)."""

    name: str
    status: str
    step: int | None = None
    max_steps: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class RankTime:
    rank: int
    step: int
    step_time_s: float | None
    data_wait_s: float | None
    age_s: float  # since this rank's last heartbeat


@dataclass(frozen=True)
class Snapshot:
    run_id: str
    now: float
    stages: tuple[StageLine, ...]
    stage: str | None  # the stage shown: the running one, else the last that ran
    status: str = "waiting"
    step: int = 0
    max_steps: int = 0
    eta_s: float | None = None
    steps_per_s: float | None = None
    samples_per_s: float | None = None
    loss: tuple[float, ...] = ()  # the stage's loss per step, oldest first (NaN stays NaN)
    throughput: tuple[float, ...] = ()  # samples/s per step, oldest first
    ranks: tuple[RankTime, ...] = ()
    gpu_util_percent: float | None = None  # None: no GPU reported (a CPU run)
    alerts: tuple[files.AlertRecord, ...] = ()
    restarts: int = 0
    rollbacks: int = 0
    spent_usd: float = 0.0  # the whole run so far, every stage and attempt
    projected_usd: float | None = None  # the run at the end of the shown stage, at its current rate
    pool: str = ""
    slots: int = 0
    price_per_slot_hour: float = 0.0
    experiment: str = ""

    @property
    def fraction(self) -> float:
        return min(1.0, self.step / self.max_steps) if self.max_steps else 0.0


def _unit_line(stage_dir: Path) -> StageLine:
    junit = stage_dir / "junit.xml"
    if not junit.exists():
        return StageLine("unit", "running", detail="running the recipe's tests")
    try:
        suites = ElementTree.parse(junit).getroot().iter("testsuite")
        total = bad = 0
        for s in suites:
            total += int(s.get("tests", 0))
            bad += int(s.get("failures", 0)) + int(s.get("errors", 0))
    except (ElementTree.ParseError, OSError, ValueError):
        return StageLine("unit", "running", detail="writing its report")
    return StageLine(
        "unit", Status.FAILED if bad or not total else Status.COMPLETED, detail=f"{total - bad}/{total} tests passed"
    )


_METRIC_FIELDS = tuple(f.name for f in fields(files.StepMetrics))


class _StageFollower:
    """The metrics of one stage, read incrementally, cut back when a later attempt rewinds."""

    def __init__(self, stage_dir: Path):
        self.lines = files.Follower(stage_dir / files.METRICS)
        self.metrics: deque[files.StepMetrics] = deque(maxlen=HISTORY)

    def read(self) -> deque[files.StepMetrics]:
        for d in self.lines.new():
            m = files.StepMetrics(**{k: d[k] for k in _METRIC_FIELDS if k in d})
            # A roll-back or a restart resumes from an earlier checkpoint: the steps after it are history
            # the run no longer has; the series shows the road the model actually took.
            while self.metrics and self.metrics[-1].step >= m.step:
                self.metrics.pop()
            self.metrics.append(m)
        return self.metrics


class _ScriptSteps:
    """The steps a script stage's output named (its metric points), with when each line arrived: a script's
    progress and rate. Cut back when a restarted attempt runs steps again."""

    def __init__(self, stage_dir: Path):
        self.lines = files.Follower(stage_dir / files.SCRIPT_METRICS)
        self.steps: deque[files.ScriptPoint] = deque(maxlen=RATE_WINDOW)

    def read(self) -> list[files.ScriptPoint]:
        for d in self.lines.new():
            p = files.ScriptPoint(**d)
            if self.steps and self.steps[-1].step == p.step:
                continue  # another metric of the same step: the step's first line says when it arrived
            while self.steps and self.steps[-1].step > p.step:
                self.steps.pop()
            self.steps.append(p)
        return list(self.steps)


class RunReader:
    """Snapshots of one run directory, each from the files as they are now.

    >>> import tempfile; d = Path(tempfile.mkdtemp()) / "r1"; d.mkdir()
    >>> RunReader(d).snapshot(now=0.0).stage is None
    True
    """

    def __init__(self, run_dir: Path, experiment: str | None = None):
        """``experiment``: the run's, when the caller knows it (else read from the run's spec.yaml once)."""
        self.run_dir = Path(run_dir)
        self.followers: dict[str, _StageFollower] = {}
        self.script_steps: dict[str, _ScriptSteps] = {}
        self.experiment: str | None = experiment

    def stage_lines(self) -> list[StageLine]:
        out = []
        for name in STAGE_ORDER:
            d = self.run_dir / name
            if not d.is_dir():
                continue
            if name == "unit":
                out.append(_unit_line(d))
                continue
            job = files.read_json(d / files.JOB) or {}
            state = files.read_supervisor_state(d)
            beat = files.read_heartbeats(d).get(0)
            result = files.read_result(d)
            ends = [a["end_step"] for a in state.attempts if a.get("end_step") is not None] if state else []
            steps = ([beat.step] if beat else []) + ([result.steps_done] if result else []) + ends
            step = max(steps) if steps else None
            status = "waiting" if state is None else str(state.final_status) if state.final_status else "running"
            detail = (state.final or {}).get("error") or "" if state is not None else ""
            if status == Status.COMPLETED and job.get("stop_at_step") is not None:
                # A launch told to stop early (smoke's first half) completed its part, not the stage.
                status, detail = str(Status.STOPPED), f"stopped at step {job['stop_at_step']} as planned"
            # A script that reports its own step total (a `total` group) counts to it, not to the spec's max_steps.
            total = files.read_script_total(d) or job.get("max_steps")
            out.append(StageLine(name, status, step, total, detail.splitlines()[0] if detail else ""))
        return out

    def snapshot(self, now: float | None = None) -> Snapshot:
        now = time.time() if now is None else now
        lines = self.stage_lines()
        experiment = self._experiment()
        # The ledger's charge of every stage, the running launch up to now: the total `runs` and `cost` show.
        spent = charged.run_usd(self.run_dir, now=now)
        training = [s for s in lines if s.name != "unit"]
        shown = next((s for s in training if s.status == "running"), training[-1] if training else None)
        if shown is None:
            current = lines[-1].name if lines else None
            return Snapshot(
                self.run_id,
                now,
                tuple(lines),
                current,
                lines[-1].status if lines else "waiting",
                spent_usd=spent,
                experiment=experiment,
            )
        d = self.run_dir / shown.name
        job = files.read_json(d / files.JOB) or {}
        optim = (job.get("spec") or {}).get("optim") or {}
        world = int(job.get("nodes") or 1) * int(job.get("procs_per_node") or 1)
        global_batch = int(optim.get("batch_size") or 0) * int(optim.get("grad_accum") or 1) * world
        metrics = self.followers.setdefault(shown.name, _StageFollower(d)).read()
        beats = files.read_heartbeats(d)
        script_steps = self.script_steps.setdefault(shown.name, _ScriptSteps(d)).read()
        step = max(shown.step or 0, metrics[-1].step if metrics else 0, script_steps[-1].step if script_steps else 0)
        max_steps = int(shown.max_steps or 0)
        state = files.read_supervisor_state(d)
        attempts = state.attempts if state is not None else []
        recent = list(metrics)[-RATE_WINDOW:]
        # The rate of this launch: a window reaching back over a restart would count its downtime as slow steps.
        launched = charged.running_since(state, job) or 0.0
        rate = _rate([m for m in recent if m.time >= launched]) or _rate(recent)
        if rate is None and script_steps:  # a script's rate: its output's steps over the time their lines arrived
            rate = _rate([p for p in script_steps if p.time >= launched]) or _rate(script_steps)
        if rate is None and 0 in beats and beats[0].step_time_s:
            rate = 1.0 / beats[0].step_time_s
        running = shown.status == "running"
        eta = (max_steps - step) / rate if running and rate and max_steps else (0.0 if not running else None)
        usd_per_s = int(job.get("slots") or 0) * float(job.get("price_per_slot_hour") or 0.0) / 3600.0
        projected = spent + eta * usd_per_s if eta is not None else None
        # The supervisor's record, read as `traingate show` and the runs table read it; roll-backs are among them.
        restarts = len(restart_record.records(attempts, final=state is not None and state.final is not None))
        rollbacks = sum(1 for a in attempts if a.get("cause") == "rollback")
        gpu = next((m.gpu_util_percent for m in reversed(metrics) if m.gpu_util_percent is not None), None)
        throughput = (
            tuple(
                global_batch / (b.time - a.time)
                for a, b in zip(metrics, list(metrics)[1:])
                if b.time > a.time and b.step == a.step + 1
            )
            if global_batch
            else ()
        )
        ranks = tuple(
            RankTime(r, b.step, b.step_time_s, b.data_wait_s, max(0.0, now - b.time)) for r, b in sorted(beats.items())
        )
        return Snapshot(
            self.run_id,
            now,
            tuple(lines),
            shown.name,
            shown.status,
            step,
            max_steps,
            eta,
            rate,
            rate * global_batch if rate and global_batch else None,
            tuple(m.loss for m in metrics),
            throughput,
            ranks,
            gpu,
            tuple(files.read_alerts(d)),
            restarts,
            rollbacks,
            spent,
            projected,
            str(job.get("pool") or ""),
            int(job.get("slots") or 0),
            float(job.get("price_per_slot_hour") or 0.0),
            experiment,
        )

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    def _experiment(self) -> str:
        if self.experiment is None:
            try:
                tree = yaml.safe_load((self.run_dir / "spec.yaml").read_text())
            except (OSError, yaml.YAMLError):
                return ""  # not written yet: asked again next time
            self.experiment = str(((tree or {}).get("identity") or {}).get("experiment", ""))
        return self.experiment


def _rate(metrics: Sequence[files.StepMetrics | files.ScriptPoint]) -> float | None:
    """Steps per second over ``metrics`` (wall clock between their lines: step, logging, checkpoints)."""
    if len(metrics) < 2 or metrics[-1].time <= metrics[0].time:
        return None
    return (metrics[-1].step - metrics[0].step) / (metrics[-1].time - metrics[0].time)


def read_snapshot(run_dir: Path, now: float | None = None) -> Snapshot:
    """A snapshot of ``run_dir`` from scratch (a watcher keeps a :class:`RunReader` instead)."""
    return RunReader(run_dir).snapshot(now)


# ---------------------------------------------------------------- is it over?


def run_over(run_dir: Path, now: float | None = None) -> str | None:
    """Why the run in ``run_dir`` has ended, or None while it goes on.

    The orchestrator (the process that runs the ladder, ``orchestrator.json``) decides when it runs on
    this host: the run is over once that process is gone (a finished `traingate run`, or one that
    died). Elsewhere, its pid says nothing here: the run is over when every stage that started has a
    verdict and nothing in the run directory changed for ``QUIET_S`` seconds (the ladder opens the
    next stage within seconds of a gate).
    """

    now = time.time() if now is None else now
    o = stale.read_orchestrator(run_dir)
    if o is not None and o.host == _host():
        return stale.gone(o)
    lines = RunReader(run_dir).stage_lines()
    if not lines or any(s.status in ("running", "waiting") for s in lines):
        return None
    newest = max((p.stat().st_mtime for p in run_dir.rglob("*") if p.is_file()), default=0.0)
    return f"every stage has ended and nothing changed for {QUIET_S:.0f} s" if now - newest >= QUIET_S else None


def _host() -> str:
    return socket.gethostname()


def summary_line(s: Snapshot) -> str:
    """One line for the end: each stage's verdict, restarts and the run's dollars."""
    parts = []
    for line in s.stages:
        steps = f" {line.step}/{line.max_steps}" if line.step is not None and line.max_steps else ""
        parts.append(f"{line.name} {line.status}{steps}")
    restarts = f", {s.restarts} restart{'s' if s.restarts != 1 else ''}" if s.restarts else ""
    return f"run {s.run_id}: {', '.join(parts) or 'no stage started'}{restarts}, {usd(s.spent_usd)} spent"


# ---------------------------------------------------------------- rich rendering

_STATUS_STYLE = {
    "running": "bold cyan",
    "waiting": "dim",
    Status.COMPLETED: "green",
    Status.STOPPED: "yellow",
    Status.PREEMPTED: "yellow",
    Status.PRUNED: "yellow",
    Status.DIVERGED: "bold red",
    Status.FAILED: "bold red",
    Status.SKIPPED: "dim",
}
_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def render(s: Snapshot, width: int = 80) -> Any:
    """``s`` as a rich renderable that fits ``width`` columns (80: an SSH terminal)."""

    spark_w = max(10, min(SPARK_WIDTH, width - 40))
    head = Text.assemble(
        ("traingate watch ", "bold"),
        (s.run_id, "bold magenta"),
        (f"  {s.experiment}" if s.experiment else "", ""),
        (time.strftime("  %H:%M:%S", time.localtime(s.now)), "dim"),
    )
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", width=8, no_wrap=True)
    grid.add_column(overflow="fold")
    stages = Text()
    for line in s.stages:
        stages.append(f"{line.name} ", "bold" if line.name == s.stage else "")
        stages.append(f"{line.status}  ", _STATUS_STYLE.get(line.status, ""))
    grid.add_row("stages", stages or Text("none started yet", "dim"))
    if s.stage is not None and s.stage != "unit":
        progress = Text(bar(s.fraction, max(10, spark_w - 10)), _STATUS_STYLE.get(s.status, ""))
        progress.append(f" {s.step}/{s.max_steps} {s.fraction:4.0%}")
        progress.append(f"  ETA {duration(s.eta_s)}" if s.status == "running" else f"  {s.status}")
        grid.add_row(s.stage, progress)
        if s.loss:
            last = s.loss[-1]
            grid.add_row(
                "loss",
                Text.assemble(
                    (sparkline(s.loss, spark_w), "cyan"),
                    f" {last:.4g}" if math.isfinite(last) else (f" {last}", "bold red"),
                ),
            )
        if s.throughput:
            rate = f" {s.samples_per_s:,.0f} samples/s" if s.samples_per_s else ""
            grid.add_row("speed", Text.assemble((sparkline(s.throughput, spark_w), "green"), rate))
        elif s.steps_per_s:
            grid.add_row("speed", f"{s.steps_per_s:.2f} steps/s")
        if s.ranks:
            grid.add_row("ranks", _ranks(s.ranks))
        if s.gpu_util_percent is not None:
            grid.add_row("gpu", f"{s.gpu_util_percent:.0f}% utilised (rank 0)")
    elif s.stage == "unit":
        unit = next(line for line in s.stages if line.name == "unit")
        grid.add_row("unit", unit.detail)
    alerts = Text()
    for a in s.alerts[-3:]:
        when = duration(s.now - a.time)
        alerts.append(f"{a.severity} ", _SEVERITY_STYLE.get(a.severity, ""))
        # ``at``: the step an event rule fired at, or the epoch second a condition began to hold
        at = time.strftime("%H:%M:%S", time.localtime(a.at)) if a.at > EPOCH_FLOOR else f"step {a.at:g}"
        alerts.append(f"{a.rule} at {at}, {when} ago: {a.outcome or a.action}\n")
    if len(s.alerts) > 3:
        alerts.append(f"(+{len(s.alerts) - 3} earlier in alerts.jsonl)", "dim")
    alerts.rstrip()
    grid.add_row("alerts", alerts if s.alerts else Text("none", "dim"))
    restarts = f"{s.restarts}" + (
        f" (of which {s.rollbacks} roll-back{'s' if s.rollbacks != 1 else ''})" if s.rollbacks else ""
    )
    grid.add_row("restarts", restarts)
    cost = Text(f"{usd(s.spent_usd)} so far")
    if s.projected_usd is not None and s.status == "running":
        cost.append(f", {usd(s.projected_usd)} at the end of {s.stage}")
    grid.add_row("cost", cost)
    if s.pool:
        grid.add_row(
            "pool",
            Text(
                f"{s.pool}: {s.slots} slot{'s' if s.slots != 1 else ''} x ${s.price_per_slot_hour:g}/slot-hour", "dim"
            ),
        )
    return Group(head, grid)


def _ranks(ranks: Sequence[RankTime]) -> Any:
    shown = (
        sorted(ranks, key=lambda r: -(r.step_time_s or 0.0))[:MAX_RANK_ROWS]
        if len(ranks) > MAX_RANK_ROWS
        else list(ranks)
    )
    out = Text()
    for r in sorted(shown, key=lambda r: r.rank):
        t = f"{r.step_time_s * 1000:.0f} ms" if r.step_time_s is not None else "-"
        wait = f" (data {r.data_wait_s * 1000:.0f} ms)" if r.data_wait_s else ""
        stale_beat = f", beat {duration(r.age_s)} ago" if r.age_s >= 10 else ""
        out.append(f"r{r.rank} step {r.step}: {t}{wait}{stale_beat}\n", "yellow" if r.age_s >= 10 else "")
    if len(ranks) > len(shown):
        out.append(f"(the {len(shown)} slowest of {len(ranks)} ranks)", "dim")
    out.rstrip()
    return out


__all__ = [
    "RankTime",
    "RunReader",
    "Snapshot",
    "StageLine",
    "bar",
    "duration",
    "read_snapshot",
    "render",
    "run_over",
    "sparkline",
    "summary_line",
    "usd",
]
