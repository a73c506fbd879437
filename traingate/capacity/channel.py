"""A job's line to its pool's authority (:mod:`traingate.capacity.authority`): wait, hold, renew, release.

The authority is started on demand by the first job that needs it (a detached
``python -m traingate.capacity.authority``; its lock makes sure only one runs) and reached over the Unix
socket in the state directory. A waiter blocks on its socket until the authority pushes its admission -
it sends nothing while it waits but a position query every ``SAY_EVERY_S`` - so a waiting job costs the
Prefect server nothing. A holder renews its lease every ``RENEW_S``; when renewals fail for long enough that
the lease may have lapsed, :meth:`Seat.stop_reason` says so and the job stops at a checkpoint rather than
train without a lease.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from traingate.capacity.authority import LEASE_S, folder_fd, paths, unix_address
from traingate.capacity.pools import CapacityConfig, CapacityError
from traingate.capacity.queue import Entry

RENEW_S = 1.0
SAY_EVERY_S = 10.0
START_TIMEOUT_S = 30.0


class AuthorityError(CapacityError):
    """The pool's authority refused a job, or could not be reached or started. One line."""


def write_config(state_dir: Path, pool: str, cfg: CapacityConfig) -> None:
    """The capacity config the authority schedules by (it re-reads the file when it changes)."""
    p = paths(state_dir, pool)["config"]
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    if p.is_file() and p.read_text() == text:
        return
    tmp = p.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)


def start_authority(state_dir: Path, pool: str, lease_s: float = LEASE_S) -> None:
    """Start the pool's authority detached (it outlives this job; a second one exits at once)."""
    log = paths(state_dir, pool)["log"]
    with open(log, "ab") as out:
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "traingate.capacity.authority",
                "--pool",
                pool,
                "--state-dir",
                str(state_dir),
                "--lease-s",
                str(lease_s),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            close_fds=True,
        )


def connect(state_dir: Path, pool: str, timeout_s: float = START_TIMEOUT_S) -> socket.socket:
    """A connection to the pool's authority, started when none answers."""
    path = paths(state_dir, pool)["sock"]
    deadline = time.monotonic() + timeout_s
    started = 0.0
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = None
        try:
            fd = folder_fd(path)
            s.connect(unix_address(path, fd))
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
        except PermissionError as e:  # another OS user's authority (its socket is 0600): retrying cannot help
            s.close()
            raise AuthorityError(
                f"the authority of pool {pool} at {path} refuses this OS user ({e.strerror}): every job of a local "
                f"pool runs as the user that owns its state dir; run as that user or give this user a state dir "
                f"of its own (TRAINGATE_STATE_DIR)"
            ) from None
        finally:
            if fd is not None:
                os.close(fd)
        if time.monotonic() > deadline:
            raise AuthorityError(
                f"the authority of pool {pool} did not answer on {path} within {timeout_s:.0f} s; "
                f"see {paths(state_dir, pool)['log']}"
            )
        if time.monotonic() - started > 5.0:  # none answers: start one (again, if the last start lost a race)
            start_authority(state_dir, pool)
            started = time.monotonic()
        time.sleep(0.05)


class Line:
    """One JSON-lines connection: send a request, read the next message (replies and pushes alike)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def recv(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next message, None when none came within ``timeout_s``; OSError when the authority is gone."""
        self.sock.settimeout(timeout_s)
        while b"\n" not in self.buf:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return None
            if not data:
                raise ConnectionResetError("the authority closed the connection")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return dict(json.loads(line))

    def close(self) -> None:
        self.sock.close()


class Seat:
    """One job's place with its pool's authority: :meth:`wait` until admitted, hold (renewed in the
    background), :meth:`release`; after a preemption ``release(requeue=True)`` and :meth:`wait` again."""

    def __init__(self, state_dir: Path, entry: Entry, say: Callable[[str], None], lease_s: float = LEASE_S):
        self.state_dir, self.entry, self.say, self.lease_s = Path(state_dir), entry, say, lease_s
        self.line: Line | None = None
        self.admitted: dict[str, Any] | None = None
        self.preempted_by: str | None = None
        self.lost: str | None = None
        self.progress: Callable[[], str] = lambda: ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    def _line(self, timeout_s: float = START_TIMEOUT_S) -> Line:
        if self.line is None:
            self.line = Line(connect(self.state_dir, self.entry.pool, timeout_s))
        return self.line

    def wait(self, stop_check: Callable[[], str | None]) -> str | None:
        """Block until the authority admits this job (None) or ``stop_check`` gives a reason to stop waiting."""
        self.preempted_by = self.lost = None
        said = time.monotonic()
        while True:
            try:
                line = self._line()
                line.send({"op": "wait", "entry": self.entry.to_json()})
                while True:
                    msg = line.recv(1.0)
                    if msg is not None and "refused" in msg:
                        raise AuthorityError(str(msg["refused"]))
                    if msg is not None and "admitted" in msg:
                        self.admitted = msg["admitted"]
                        self._hold()
                        return None
                    if msg is not None and msg.get("queued"):
                        self.say(str(msg["queued"]))
                    if msg is not None and msg.get("status"):
                        self.say(str(msg["status"]))
                    if (why := stop_check()) is not None:
                        self._close()  # the authority removes a waiter whose connection closed
                        return why
                    if time.monotonic() - said >= SAY_EVERY_S:
                        said = time.monotonic()
                        line.send({"op": "where"})
            except OSError:  # the authority went away: the next one takes the queue from here
                self._close()
                time.sleep(0.2)

    def _hold(self) -> None:
        self._stop.clear()
        self._keeper = threading.Thread(target=self._keep, name="tg-seat", daemon=True)
        self._keeper.start()

    def _keep(self) -> None:
        """Renew every RENEW_S. A broken line is re-made (a restarted authority knows this job from its
        records); if no renewal got through for half a lease, the job is told to stop (``stop_reason``)."""
        last_ok = time.monotonic()
        while not self._stop.wait(RENEW_S):
            try:
                with self._lock:
                    if self.line is None:  # reconnect (starting an authority) only while the lease may still hold
                        left = max(0.1, self.lease_s / 2 - (time.monotonic() - last_ok))
                        self._line(left).send({"op": "hold", "job_id": self.entry.job_id})
                    else:
                        self.line.send({"op": "renew", "progress": self.progress()})
                    msg = self._line().recv(RENEW_S * 5)
            except (OSError, AuthorityError) as e:
                self._close()
                msg = None
                why = f"renewal failed ({e})"
            else:
                why = "no answer to a renewal"
            if msg is not None and "lost" in msg:
                self.lost = str(msg["lost"])
                return
            if msg is not None and msg.get("renewed"):
                last_ok = time.monotonic()
                if msg.get("preempt") and self.preempted_by is None:
                    self.preempted_by = str(msg["preempt"])
                continue
            if time.monotonic() - last_ok > self.lease_s / 2:
                self.lost = f"the lease on {self.entry.pool} could not be renewed for {self.lease_s / 2:.0f} s: {why}"
                return

    def stop_reason(self) -> str | None:
        """Why the job must stop now: preempted, or its lease lost (it never trains without one)."""
        if self.lost is not None:
            return f"slots lost: {self.lost}; stopping at a checkpoint"
        if self.preempted_by is not None:
            return f"preempted by {self.preempted_by} (a higher priority class needs the slots)"
        return None

    def release(self, requeue: bool = False, kind: str = "", held_s: float = 0.0) -> None:
        """Give the slots back; ``requeue``: stay in the queue (``wait`` again) to resume."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=RENEW_S * 10)
            self._keeper = None
        if self.lost is None:
            with self._lock:
                try:
                    line = self._line()
                    line.send({"op": "release", "requeue": requeue, "kind": kind, "held_s": held_s})
                    while (msg := line.recv(10.0)) is not None and not msg.get("released"):
                        if "lost" in msg:
                            break
                except OSError as e:  # its lease lapses instead: the slots come back all the same
                    self.say(f"release not confirmed by the authority of {self.entry.pool} ({e}); its lease lapses")
        self.admitted = None
        if not requeue:
            self._close()

    def _close(self) -> None:
        if self.line is not None:
            self.line.close()
            self.line = None
