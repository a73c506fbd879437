"""What `traingate run` shows while the ladder runs: a progress bar with ETA per stage, or, when
stdout is not a terminal (CI logs), one line per stage transition.

A thread in the CLI process follows the files of the run this process orchestrates (found by its
``orchestrator.json``, which the ladder writes as it starts or resumes) through
:class:`traingate.monitor.dashboard.RunReader`: the flow and its tasks are not touched, and what
goes to Prefect's logs does not change. In a terminal the training processes' own output lines
(the supervisor pumps them into the task's log from its ``proc-reader`` thread) are kept off the
screen; they stay in each stage's ``stdout.log`` and in Prefect. Every other log line is printed
above the bar, which is redrawn below it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from flows.cli import console
from traingate.launch import proc
from traingate.monitor import dashboard
from traingate.settings import Settings

PROCESS_OUTPUT_THREAD = proc.READER_THREAD
BAR_EVERY_S = 0.5
LINES_EVERY_S = 1.0
_PREFIX = "traingate:"


class Transitions:
    """One line per stage transition of a run directory: started, restarted, ended.

    ``started``: stages that had already ended before this time (the finished stages of a resumed
    run) are not announced again.
    """

    def __init__(self, run_dir: Path, started: float):
        self.reader = dashboard.RunReader(run_dir)
        self.started = started
        self.seen: dict[str, str] = {}
        self.relaunches: dict[str, int] = {}
        self.running_since: dict[str, float] = {}

    def poll(self, now: float | None = None) -> tuple[dashboard.Snapshot, list[str]]:
        now = time.time() if now is None else now
        snap = self.reader.snapshot(now)
        out: list[str] = []
        for line in snap.stages:
            before = self.seen.get(line.name)
            if before is None and line.status not in ("running", "waiting") and self._ended_before(line.name):
                self.seen[line.name] = line.status
                continue
            if line.status == "running":
                self.running_since.setdefault(line.name, now)
                # Each attempt that ended while the stage runs on was followed by a launch (a new
                # supervision, smoke's second half, starts counting again: that is not a relaunch).
                relaunches = self._ended_attempts(line.name)
                if relaunches > self.relaunches.get(line.name, 0):
                    out.append(
                        f"{_PREFIX} {line.name} relaunched (launch {relaunches + 1}): {self._last_cause(line.name)}"
                    )
                self.relaunches[line.name] = relaunches
            if line.status == before or line.status == "waiting":
                continue
            if line.status == "running" and not (self.reader.run_dir / line.name / dashboard.files.JOB).exists():
                # Its supervisor has started and its first launch is not written yet: announced once it is,
                # with its pool, world and step total.
                continue
            self.seen[line.name] = line.status
            out.append(self._describe(line, snap, now))
        return snap, out

    def _describe(self, line: dashboard.StageLine, snap: dashboard.Snapshot, now: float) -> str:
        if line.name == "unit":
            return f"{_PREFIX} unit {line.status}: {line.detail}"
        if line.status == "running":
            job = dashboard.files.read_json(self.reader.run_dir / line.name / dashboard.files.JOB) or {}
            world = int(job.get("nodes") or 1) * int(job.get("procs_per_node") or 1)
            steps = f"{line.max_steps} steps on " if line.max_steps else ""  # a script's total may come later
            return (
                f"{_PREFIX} {line.name} running: {steps}{world} "
                f"process{'es' if world != 1 else ''} ({job.get('pool', '?')})"
            )
        took = now - self.running_since[line.name] if line.name in self.running_since else None
        steps = f" at step {line.step}/{line.max_steps}" if line.step is not None else ""
        why = f": {line.detail}" if line.detail and line.status != "completed" else ""
        return (
            f"{_PREFIX} {line.name} {line.status}{steps}"
            f"{f' in {dashboard.duration(took)}' if took is not None else ''}, run {dashboard.usd(snap.spent_usd)}"
            f" so far{why}"
        )

    def _ended_attempts(self, stage: str) -> int:
        """Attempts that ended with a cause (a failure, a preemption): each is followed by a relaunch. One that
        ended without a cause completed or stopped as planned (smoke's half-way checkpoint): no relaunch,
        though the stage still reads "running" until its supervisor writes the verdict."""
        state = dashboard.files.read_supervisor_state(self.reader.run_dir / stage)
        return sum(1 for a in state.attempts if a.get("ended_at") is not None and a.get("cause")) if state else 0

    def _last_cause(self, stage: str) -> str:
        state = dashboard.files.read_supervisor_state(self.reader.run_dir / stage)
        ended = [a for a in (state.attempts if state else []) if a.get("cause")]
        return f"the last one ended with {ended[-1]['cause']}" if ended else "a new launch"

    def _ended_before(self, stage: str) -> bool:
        d = self.reader.run_dir / stage
        marker = d / ("junit.xml" if stage == "unit" else dashboard.files.SUPERVISOR)
        try:
            return marker.stat().st_mtime < self.started
        except OSError:
            return False


def bar_line(snap: dashboard.Snapshot | None, width: int, waiting_s: float) -> str:
    """The one line drawn at the bottom of the terminal, at most ``width`` characters."""
    if snap is None or snap.stage is None:
        text = f"starting the run ({dashboard.duration(waiting_s)})"
    elif snap.stage == "unit":
        text = f"unit   {next(s.detail for s in snap.stages if s.name == 'unit')} ({dashboard.duration(waiting_s)})"
    else:
        loss = f"  loss {snap.loss[-1]:.4g}" if snap.loss else ""
        eta = f"ETA {dashboard.duration(snap.eta_s)}" if snap.status == "running" else snap.status
        tail = f" {snap.step}/{snap.max_steps} {snap.fraction:4.0%}  {eta}{loss}  {dashboard.usd(snap.spent_usd)}"
        head = f"{snap.stage:<6} "
        # the last column stays free: a line that fills the terminal wraps on some, and \r then misses it
        bar_w = max(10, min(40, width - 1 - len(head) - len(tail)))
        text = f"{head}{dashboard.bar(snap.fraction, bar_w)}{tail}"
    return text[: max(1, width - 1)]


class _Terminal:
    """The bar at the bottom of a terminal; log lines are printed above it (under one lock)."""

    def __init__(self, out: IO[str]):
        self.out, self.lock, self.text = out, threading.RLock(), ""

    def clear(self) -> None:
        if self.text:
            self.out.write("\r\x1b[K")
            self.out.flush()

    def draw(self, text: str | None = None) -> None:
        with self.lock:
            self.text = self.text if text is None else text
            if self.text:
                self.out.write("\r" + self.text + "\x1b[K")
                self.out.flush()

    def print_above(self, line: str) -> None:
        with self.lock:
            self.clear()
            self.out.write(line + "\n")
            self.draw()


class _AboveTheBar(logging.Handler):
    """Stands in for a console handler while the bar is drawn: the training processes' own lines stay
    off the terminal; every other record is printed by the console handler, above the bar."""

    def __init__(self, inner: logging.Handler, terminal: _Terminal):
        super().__init__(inner.level)
        self.inner, self.terminal = inner, terminal

    def handle(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        if record.threadName == PROCESS_OUTPUT_THREAD and record.levelno <= logging.INFO:
            return False
        with self.terminal.lock:
            self.terminal.clear()
            self.inner.handle(record)
            self.terminal.draw()
        return True


def _console_handlers() -> list[tuple[logging.Logger, logging.Handler]]:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    out: list[tuple[logging.Logger, logging.Handler]] = []
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and _to_terminal(h.stream):
                out.append((lg, h))
    return out


def _to_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    if callable(isatty):
        return bool(isatty())
    # A stream without isatty forwards to another: MLflow's writes to whatever sys.stderr is at the time.
    return stream is not None and sys.stderr.isatty()


class Follower:
    """The thread that follows this process's run and reports it (see the module docstring)."""

    def __init__(self, settings: Settings, out: IO[str], tty: bool):
        self.runs = settings.state_dir / "runs"
        self.out, self.tty = out, tty
        self.started = time.time()
        self.transitions: Transitions | None = None
        self.terminal = _Terminal(out) if tty else None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="traingate-terminal", daemon=True)

    def _find_run(self) -> Path | None:
        """The run directory this process claimed (``orchestrator.json`` written since we started)."""
        for o in self.runs.glob("*/orchestrator.json"):
            data = dashboard.files.read_json(o)
            try:
                if isinstance(data, dict) and data.get("pid") == os.getpid() and o.stat().st_mtime >= self.started - 1:
                    return o.parent
            except OSError:
                continue
        return None

    def tick(self) -> None:
        if self.transitions is None:
            run_dir = self._find_run()
            if run_dir is not None:
                self.transitions = Transitions(run_dir, self.started)
                console.attach(run_dir)  # the run's log file, from the moment the run is known
        snap, lines = self.transitions.poll() if self.transitions is not None else (None, [])
        if self.terminal is None:
            for line in lines:
                print(line, file=self.out, flush=True)
            return
        for line in lines:
            self.terminal.print_above(line)
        width = shutil.get_terminal_size((80, 24)).columns
        self.terminal.draw(bar_line(snap, width, time.time() - self.started))

    def _loop(self) -> None:
        every = BAR_EVERY_S if self.tty else LINES_EVERY_S
        while not self.done.wait(every):
            self.tick()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.tick()  # the last transitions (the final stage's verdict) before the CLI's summary
        if self.terminal is not None:
            with self.terminal.lock:
                self.terminal.clear()
                self.terminal.text = ""


@contextlib.contextmanager
def follow_run(settings: Settings, out: IO[str] | None = None) -> Iterator[Follower]:
    """Report the run this process orchestrates while the block runs (`traingate run`, `resume`)."""
    out = sys.stdout if out is None else out
    tty = out.isatty()
    follower = Follower(settings, out, tty)
    swapped: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []
    progress_var = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    progress_before = os.environ.get(progress_var)
    if tty:
        assert follower.terminal is not None
        for lg, h in _console_handlers():
            stand_in = _AboveTheBar(h, follower.terminal)
            lg.removeHandler(h)
            lg.addHandler(stand_in)
            swapped.append((lg, h, stand_in))
        # MLflow's download bars would be drawn over ours (they end in a carriage return, not a line).
        os.environ[progress_var] = "false"
    follower.thread.start()
    try:
        yield follower
    finally:
        follower.stop()
        for lg, handler, added in swapped:
            lg.removeHandler(added)
            lg.addHandler(handler)
        if tty:
            if progress_before is None:
                os.environ.pop(progress_var, None)
            else:
                os.environ[progress_var] = progress_before
