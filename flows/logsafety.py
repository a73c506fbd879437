"""Redaction on everything this process logs or reports: Prefect's handlers included.

Prefect ships flow- and task-run logs to its API (``APILogHandler``, stored in the server's log
table) and turns ``print`` inside a ``log_prints`` run into log records; libraries (MLflow,
boto, uvicorn) log to their own loggers. :func:`install` redacts all of them:

- every record at creation (:func:`traingate.redact.install_log_redaction`), whichever logger,
  handler or later logging reconfiguration it meets: Prefect's handlers are created when Prefect
  is imported, which the CLI defers (``traingate validate`` must not pay 2 s for it), and are
  reconfigured by ``setup_logging``; a record is redacted before any handler sees it;
- a :class:`~traingate.redact.RedactingFilter` on every handler that exists when it runs (the
  root logger's; Prefect's console, API and debug handlers if Prefect is loaded), for records
  built without the record factory (``logging.makeLogRecord``);
- ``warnings`` and uncaught exceptions, which reach the terminal without logging;
- ``sys.stdout`` and ``sys.stderr``, line by line: libraries write there directly (MLflow's
  "View run ... at: <tracking URI>" is a ``sys.stdout.write``).

The CLI calls it once at start; calling it again (after importing Prefect) only adds filters.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
import warnings
from typing import Any

from traingate.redact import RedactingFilter, install_log_redaction, redact

_FILTER = RedactingFilter()


def install() -> None:
    """Install redaction for this process (idempotent)."""
    install_log_redaction()
    for handler in _all_handlers():
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    _redact_warnings()
    _redact_uncaught()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))


class RedactingStream:
    """A text stream that redacts what it passes on, a whole line at a time.

    Whole lines, because a secret may arrive split over several ``write`` calls. A partial line
    waits for its newline, a ``flush()`` (``print(..., flush=True)``, ``input()``, exit) or 8 KiB.
    Everything else (``fileno``, ``isatty``, ``encoding``, ``buffer``) is the wrapped stream's.
    """

    _HOLD = 8192

    def __init__(self, raw: Any):
        self._raw = raw
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            head, newline, self._pending = (self._pending + text).rpartition("\n")
            if newline:
                self._raw.write(redact(head + newline))
            if len(self._pending) > self._HOLD:
                self._raw.write(redact(self._pending))
                self._pending = ""
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._raw.write(redact(self._pending))
                self._pending = ""
        self._raw.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _all_handlers() -> list[logging.Handler]:
    loggers: list[logging.Logger] = [logging.getLogger()]
    loggers += [lg for lg in list(logging.Logger.manager.loggerDict.values()) if isinstance(lg, logging.Logger)]
    seen: dict[int, logging.Handler] = {}
    for lg in loggers:
        for h in lg.handlers:
            seen.setdefault(id(h), h)
    return list(seen.values())


def _redact_warnings() -> None:
    original = warnings.formatwarning
    if getattr(original, "_traingate_redacting", False):
        return

    def formatwarning(*args: Any, **kwargs: Any) -> str:
        return redact(original(*args, **kwargs))

    formatwarning._traingate_redacting = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


def _redact_uncaught() -> None:
    if getattr(sys.excepthook, "_traingate_redacting", False):
        return

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        sys.stderr.write(redact("".join(traceback.format_exception(exc_type, exc, tb))))

    def thread_excepthook(args: Any) -> None:
        if issubclass(args.exc_type, SystemExit):  # as threading's own hook: a thread's exit is no error
            return
        name = args.thread.name if args.thread is not None else "?"
        sys.stderr.write(
            redact(
                f"Exception in thread {name}:\n"
                + "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
            )
        )

    excepthook._traingate_redacting = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
