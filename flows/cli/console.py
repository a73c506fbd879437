"""What a command shows on the terminal, and the log file that keeps everything else.

By default a terminal shows traingate's own lines only: what the command prints (the plan, the progress
lines or bar, summaries, refusals) and traingate's log records at WARNING and above, as
``traingate: WARNING <message>``. The rest of what the process would print (Prefect's and MLflow's log
lines and banners, any library's Python warnings, traingate's own INFO records) goes to a log file:

- ``<state dir>/runs/<run id>/run.log`` for a command that runs the ladder (``run``, ``resume``,
  ``ci``), from the moment the run is known (what came before is kept in memory until then);
- ``<state dir>/logs/<command>.log`` for every other command (written at the end, and only where the
  state dir exists: a refused command leaves nothing behind).

``-v`` shows all of it on the terminal as well; the log file is written either way. MLflow's artifact
download bars are off unless ``-v`` (``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR``; the training processes
inherit it): a bar redrawn with carriage returns is noise in a log file and draws over the run's own bar.

Two routes reach a terminal, and each is split where it starts:

- log records: two handlers on the root logger. Prefect leaves the root logger alone when the
  application has put handlers with formatters on it (``prefect.logging.configuration.setup_logging``),
  so Prefect's records propagate to them; every other library's do too.
- writes to ``sys.stdout`` and ``sys.stderr`` (``print``, a library's own stream handler such as
  MLflow's, ``warnings``, download bars): the code that called ``write`` decides. A write from a
  module of traingate's (``flows/``, ``tasks/``, ``traingate/``) goes to the terminal; any other goes to
  the log file.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from traingate.launch.proc import READER_THREAD
from traingate.redact import redact
from traingate.settings import Settings

RUN_LOG = "run.log"
LOGS_DIR = "logs"
PROGRESS_BAR_VAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
KEEP_LINES = 20_000  # held in memory until the run's log file is known; a run claims its directory in seconds
ROTATE_BYTES = 4 << 20  # a command log past this is moved to <name>.1 before the next command appends
_CODE = Path(__file__).resolve().parents[2]
OUR_CODE = tuple(str(_CODE / pkg) + os.sep for pkg in ("flows", "tasks", "traingate"))
# Prefect replaces the builtin print while a flow with log_prints runs, for every thread; its stand-in
# calls the real print for a thread outside the run, so the line's writer is the stand-in's caller.
PRINT_PATCHES = frozenset({"print_as_log"})


class FileFormatter(logging.Formatter):
    """A log file line: time, level, where from (Prefect's flow and task runs by name), thread, message."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(origin)s [%(threadName)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        run = getattr(record, "task_run_name", None) or getattr(record, "flow_run_name", None)
        record.origin = f"{record.name} {run!r}" if run else record.name
        return super().format(record)


_FILE_FORMAT = FileFormatter()
_VERBOSE_FORMAT = logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s", "%H:%M:%S")


def ours(record: logging.LogRecord) -> bool:
    """A record traingate's code logged (its flows and tasks log through Prefect's run loggers, so the
    logger's name does not say; the line that called the logger does), other than a training process's
    output line, which the supervisor hands on from its reader thread and keeps in the stage's stdout.log."""
    return record.pathname.startswith(OUR_CODE) and record.threadName != READER_THREAD


class RunLogHandler(logging.Handler):
    """The log file: held in memory until :meth:`open` names it, appended to from then on.

    The class name has no leading underscore on purpose: Prefect keeps the root logger's handlers only
    when they look like an application's (a formatter, a public class).
    """

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.setFormatter(_FILE_FORMAT)
        self.path: Path | None = None
        self._held: list[str] = []
        self._dropped = 0
        self._file: Any = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write_line(self.format(record))
        except Exception:  # as logging's own handlers: a failed write reports itself and the run goes on
            self.handleError(record)

    def write_line(self, text: str) -> None:
        text = redact(text.rstrip("\n")) + "\n"
        with self.lock:  # type: ignore[union-attr]
            if self._file is not None:
                self._file.write(text)
                self._file.flush()
                return
            self._held.append(text)
            if len(self._held) > KEEP_LINES:
                del self._held[0]
                self._dropped += 1

    def open(self, path: Path) -> None:
        """Append to ``path`` from now on, starting with what was held (a second call changes nothing)."""
        with self.lock:  # type: ignore[union-attr]
            if self._file is not None:
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
            self.path = path
            command = redact(" ".join(sys.argv[1:]))  # a --set value may carry a secret flag's value
            self._file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} traingate {command}\n")
            if self._dropped:
                self._file.write(f"({self._dropped} earlier lines were not kept)\n")
            self._file.writelines(self._held)
            self._file.flush()
            self._held = []

    def held(self) -> list[str]:
        with self.lock:  # type: ignore[union-attr]
            return list(self._held)

    def close(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            if self._file is not None:
                self._file.close()
                self._file = None
        super().close()


class TerminalHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """traingate's records at WARNING and above, one line each; with ``-v``, every record at INFO and above."""

    def __init__(self, stream: Any, verbose: bool):
        super().__init__(stream)
        self.verbose = verbose
        self.setLevel(logging.INFO if verbose else logging.WARNING)
        self.setFormatter(_VERBOSE_FORMAT)

    def filter(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        return (self.verbose or ours(record)) and bool(super().filter(record))

    def format(self, record: logging.LogRecord) -> str:
        if self.verbose:
            return super().format(record)
        lines = record.getMessage().strip().splitlines() or [""]
        more = " (more in the log)" if len(lines) > 1 or record.exc_info else ""
        return f"traingate: {record.levelname} {lines[0]}{more}"


class RoutingStream:
    """Stands in for ``sys.stdout`` or ``sys.stderr``: a write from traingate's code goes to the terminal
    stream, any other to the log file (and with ``-v`` to the terminal too). ``isatty`` answers each
    caller for the stream it writes to: a library is writing to a file. Everything else is the terminal's."""

    def __init__(self, terminal: Any, name: str, log: RunLogHandler, verbose: bool):
        self.terminal, self.name, self.log, self.verbose = terminal, name, log, verbose
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        return self._write(text, sys._getframe(1))

    def writelines(self, lines: Any) -> None:
        caller = sys._getframe(1)
        for line in lines:
            self._write(line, caller)

    def _write(self, text: str, caller: Any) -> int:
        if _from_our_code(caller):
            return int(self.terminal.write(text))
        if self.verbose:
            self.terminal.write(text)
        with self._lock:
            # a download bar redraws itself with carriage returns: each frame is a line of the log
            head, newline, self._pending = (self._pending + text.replace("\r", "\n")).rpartition("\n")
        for line in head.split("\n") if newline else []:
            if line.strip():
                self.log.write_line(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.name}: {line}")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, ""
        if pending.strip():
            self.log.write_line(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.name}: {pending}")
        self.terminal.flush()

    def isatty(self) -> bool:
        return _from_our_code(sys._getframe(1)) and bool(self.terminal.isatty())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.terminal, name)


def terminal_of(stream: Any) -> Any:
    """The terminal stream under ``stream`` (``sys.stdout`` while a session routes it), for a library
    that draws traingate's own screen (rich, in `traingate watch`)."""
    return stream.terminal if isinstance(stream, RoutingStream) else stream


def _from_our_code(caller: Any) -> bool:
    while caller.f_back is not None and caller.f_code.co_name in PRINT_PATCHES:
        caller = caller.f_back
    return bool(caller.f_code.co_filename.startswith(OUR_CODE))


class PrefectHome(importlib.abc.MetaPathFinder):
    """Makes the state dir just before Prefect is first imported, when Prefect's home lies in it.

    Prefect makes its home on import with a ``mkdir`` that makes no parents: in a directory whose state
    dir is not made yet, a first command would warn "Failed to create the Prefect home directory".
    Making the state dir any earlier would leave it behind a refused spec.
    """

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "prefect" and Path(os.environ.get("PREFECT_HOME", "")).parent == self.state_dir:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        return None  # the usual finders import it


class _Session:
    def __init__(self, command: str, settings: Settings, verbose: bool):
        self.command, self.settings, self.verbose = command, settings, verbose
        self.log = RunLogHandler()
        self.terminal = TerminalHandler(sys.stderr, verbose)
        self.home = PrefectHome(settings.state_dir)


_current: _Session | None = None


def attach(run_dir: Path) -> Path | None:
    """Write the log to ``run_dir``'s ``run.log`` from now on (what was held first); returns its path."""
    if _current is None:
        return None
    _current.log.open(run_dir / RUN_LOG)
    return _current.log.path


def log_path() -> Path | None:
    """Where this command's log is written, once known."""
    return _current.log.path if _current is not None else None


@contextlib.contextmanager
def session(command: str, settings: Settings, verbose: bool) -> Iterator[None]:
    """Route this process's output as the module docstring says while the block runs, then put back
    the streams, handlers and settings it found."""
    global _current
    s = _Session(command, settings, verbose)
    root, traingate_logger = logging.getLogger(), logging.getLogger("traingate")
    # Handlers that print to the terminal already (Prefect's console handler where Prefect was imported
    # before this, as in tests) step aside: the terminal handler decides what reaches the terminal.
    aside = [
        h for h in root.handlers if type(h) is logging.StreamHandler or type(h).__name__ == "PrefectConsoleHandler"
    ]
    for h in aside:
        root.removeHandler(h)
    root.addHandler(s.log)
    root.addHandler(s.terminal)
    level_before = traingate_logger.level
    traingate_logger.setLevel(logging.INFO)  # the log keeps traingate's INFO records, the terminal does not
    streams = sys.stdout, sys.stderr
    sys.stdout = RoutingStream(streams[0], "stdout", s.log, verbose)  # type: ignore[assignment]
    sys.stderr = RoutingStream(streams[1], "stderr", s.log, verbose)  # type: ignore[assignment]
    logging.captureWarnings(True)
    bar_before = os.environ.get(PROGRESS_BAR_VAR)
    if not verbose:
        os.environ.setdefault(PROGRESS_BAR_VAR, "false")
    sys.meta_path.insert(0, s.home)
    _current = s
    try:
        yield
    except Exception:
        logging.getLogger("traingate.cli").exception("the command ended with an exception")
        raise
    finally:
        _current = None
        sys.meta_path.remove(s.home)
        if bar_before is None:
            os.environ.pop(PROGRESS_BAR_VAR, None)
        logging.captureWarnings(False)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = streams
        traingate_logger.setLevel(level_before)
        root.removeHandler(s.terminal)
        root.removeHandler(s.log)
        for h in aside:
            root.addHandler(h)
        _keep(s)


def _keep(s: _Session) -> None:
    """A command that ran no ladder: its log goes to ``logs/<command>.log`` under an existing state dir.
    Without one the command made nothing (a refused spec, a first `validate`), and its log is not kept."""
    if s.log.path is None and s.log.held() and s.settings.state_dir.is_dir():
        path = s.settings.state_dir / LOGS_DIR / f"{s.command}.log"
        with contextlib.suppress(OSError):
            if path.stat().st_size > ROTATE_BYTES:
                path.replace(path.with_name(path.name + ".1"))
        s.log.open(path)
    s.log.close()
