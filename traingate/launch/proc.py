"""Run one process tree: stream its output to a file (and a callback), stop it cleanly.

The tree gets its own process group. torchrun starts each worker in a session of its
own, so signals go to the group *and* to every descendant seen while the tree ran
(a worker orphaned by a dead torchrun is no longer anyone's child, but still ours to stop):
SIGTERM first (the runtime then writes an emergency checkpoint), SIGKILL after a grace period.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from traingate.redact import redact
from traingate.secrets import resolve_tree

# The thread that reads a process tree's output and hands each line on: the CLI keeps its lines off the terminal.
READER_THREAD = "proc-reader"


@dataclass
class ProcResult:
    returncode: int
    duration_s: float
    tail: list[str] = field(default_factory=list)
    timed_out: bool = False
    stopped: bool = False  # stopped on request (cancel/preempt)
    log_error: OSError | None = None  # the output log could not be written (the output was still read)
    pid: int | None = None  # the tree's leader

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None


class ProcessTree:
    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        cwd: str | Path,
        log_path: Path,
        on_line: Callable[[str], None] | None = None,
        tail_lines: int = 50,
    ):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # ${env:NAME} references in a command (a script's --api-token) are resolved here, at the last moment,
        # from the child's environment; everything printed is redacted before it is written or passed on.
        popen = subprocess.Popen(
            resolve_tree(cmd, env=env, field="command"),
            env=env,
            cwd=str(cwd),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            errors="replace",
            bufsize=1,
        )
        self._attach(popen, cmd, log_path, on_line, tail_lines)

    @classmethod
    def adopt(
        cls,
        popen: subprocess.Popen,
        cmd: list[str],
        log_path: Path,
        on_line: Callable[[str], None] | None = None,
        tail_lines: int = 50,
    ) -> ProcessTree:
        """A tree of a process started earlier (its own session, text stdout+stderr on one pipe), from now on:
        its output, timeout and stop as for a tree started here (a pre-started unit stage, see
        traingate.launch.warm_pytest)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        tree = cls.__new__(cls)
        tree._attach(popen, cmd, log_path, on_line, tail_lines)
        return tree

    def _attach(
        self,
        popen: subprocess.Popen,
        cmd: list[str],
        log_path: Path,
        on_line: Callable[[str], None] | None,
        tail_lines: int,
    ) -> None:
        self.cmd, self.log_path, self.popen = cmd, log_path, popen
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._on_line = on_line
        self.started = time.monotonic()
        self.stop_requested = False
        self.log_error: OSError | None = None  # writing the log failed (e.g. a full disk); output still drained
        self._seen: dict[int, psutil.Process] = {}
        self._exit = _exit_notice(popen.pid)
        self._forget_exit = weakref.finalize(self, _close, self._exit)  # at the end of wait(), or with the tree
        self._reader = threading.Thread(target=self._pump, name=READER_THREAD, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        log = None
        try:
            log = open(self.log_path, "a")
        except OSError as e:
            self.log_error = e
        for raw in self.popen.stdout:
            raw = redact(raw)
            line = raw.rstrip("\n")
            self._tail.append(line)
            # The reader (a script's metric points) before the log: a line the log shows is one the stage's
            # record has read, even when the supervisor is killed between the two.
            if self._on_line is not None:
                self._on_line(line)
            if log is not None:
                try:
                    log.write(raw)
                    log.flush()
                except OSError as e:
                    # A full disk must not stop the draining: a child blocked on a full pipe hangs instead
                    # of failing. The tail stays in memory; the error is reported with the result.
                    self.log_error, log = e, None
        if log is not None:
            log.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def refresh_descendants(self) -> None:
        """Remember the tree's current descendants (called on every wait tick)."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.popen.pid).children(recursive=True):
                self._seen.setdefault(child.pid, child)

    def signal_group(self, sig: int) -> None:
        self.refresh_descendants()
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass  # already gone
        for pid, p in list(self._seen.items()):
            try:
                p.send_signal(sig)  # psutil refuses a pid that was reused by an unrelated process
            except psutil.NoSuchProcess:
                del self._seen[pid]
            except psutil.Error:
                pass

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the tree, wait up to grace_s, then SIGKILL what is left."""
        self.stop_requested = True
        self.signal_group(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.signal_group(signal.SIGKILL)  # stragglers in the group, even if the leader exited

    def poll(self) -> int | None:
        return self.popen.poll()

    def _wait_exit(self, timeout_s: float) -> None:
        """Until the leader exits, at most ``timeout_s``. Its process file descriptor says so as it happens;
        ``Popen.wait`` with a timeout polls, sleeping up to 50 ms between looks."""
        if self._exit is not None:
            select.select([self._exit], [], [], timeout_s)
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)

    def wait(
        self,
        timeout_s: float | None = None,
        grace_s: float = 30.0,
        tick: Callable[[], bool] | None = None,
        tick_every_s: float = 0.5,
    ) -> ProcResult:
        """Wait for exit. ``tick`` is called periodically; returning True stops the tree."""
        deadline = None if timeout_s is None else self.started + timeout_s
        timed_out = False
        while self.popen.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                self.stop(grace_s)
                break
            self.refresh_descendants()
            if tick is not None and tick():
                self.stop(grace_s)
                break
            self._wait_exit(tick_every_s)
        rc = self.popen.wait()
        self._forget_exit()
        self._exit = None
        self.signal_group(signal.SIGKILL)  # orphans of a dead leader must not outlive the stage
        self._reader.join(timeout=10)
        return ProcResult(
            rc,
            time.monotonic() - self.started,
            list(self._tail),
            timed_out,
            self.stop_requested,
            self.log_error,
            self.popen.pid,
        )


def run(
    cmd: list[str],
    env: dict[str, str],
    cwd: str | Path,
    log_path: Path,
    timeout_s: float | None = None,
    on_line: Callable[[str], None] | None = None,
) -> ProcResult:
    return ProcessTree(cmd, env, cwd, log_path, on_line).wait(timeout_s)


def _exit_notice(pid: int) -> int | None:
    """A process file descriptor of ``pid`` (readable once it exits), where the kernel has them (Linux 5.3)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
