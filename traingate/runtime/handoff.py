"""The hand-off between a thin entry and a zygote that forks a pre-imported process in its place.

Two zygotes use it: a stage's (:mod:`traingate.runtime.warm`: torchrun's workers) and a process pool's
(``flows.warm_engine``: Prefect flow runs). The entry is the command its launcher started; it sends the
zygote its request and its stdin/stdout/stderr, relays SIGTERM and SIGINT to the forked child and ends
as the child ended, so the launcher sees the child as it would see a cold process. Standard library
only: an entry imports nothing heavy before it knows whether a zygote serves it.

Wire format, entry -> zygote: ``!I`` length + JSON request, fds 0-2 attached (SCM_RIGHTS).
Zygote/child -> entry: ``!ci`` records: ``R`` refused (start cold), ``P`` pid, ``X`` exit code,
``S`` signal number.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

LEN = struct.Struct("!I")
REC = struct.Struct("!ci")
RELAYED = (signal.SIGTERM, signal.SIGINT)


def ask(path: str | None, request: dict[str, Any], cold: Callable[[], int]) -> int:
    """As the entry: have the zygote at ``path`` fork the process, wait for it and return its exit status
    (a death by a signal is re-raised as that signal). ``cold()`` runs it here instead when no zygote
    answers, the zygote refuses, or the zygote goes away before a child exists."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not path:
            raise OSError("no zygote")
        conn.connect(path)
    except OSError:
        conn.close()
        return cold()
    pid: list[int] = []
    pending: list[int] = []

    def relay(signum: int, frame: object) -> None:
        if not pid:
            pending.append(signum)  # delivered once the child exists
            return
        try:
            os.kill(pid[0], signum)
        except ProcessLookupError:
            pass  # it exited already; its status is on its way

    def start_cold() -> int:
        """No child exists and none will: the signals are this process's own again; one that came meanwhile ends
        it as that signal would have, else the process starts here, slowly but correctly."""
        conn.close()
        for sig in RELAYED:
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
        return 128 + pending[0] if pending else cold()

    for sig in RELAYED:
        signal.signal(sig, relay)
    body = json.dumps(request).encode()
    try:
        conn.sendmsg([LEN.pack(len(body)) + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("3i", 0, 1, 2))])
    except OSError:
        return start_cold()
    reader = conn.makefile("rb")
    while True:
        try:
            record = reader.read(REC.size)
        except OSError:  # reset: the zygote died with our request unread, which is an end of input too
            record = b""
        if len(record) < REC.size:
            if not pid:  # the zygote went away before a child existed
                return start_cold()
            # The child and the zygote are both gone without a word: the child was killed, and the zygote
            # with it (or before it); report it the way a killed process shows.
            return die(signal.SIGKILL)
        kind, value = REC.unpack(record)
        if kind == b"R":
            return start_cold()
        if kind == b"P":
            pid.append(value)
            for waiting in pending:
                relay(waiting, None)
        elif kind == b"X":
            return value
        elif kind == b"S":
            return die(value)


def die(signum: int) -> int:
    """End this process by ``signum``, as the forked child did (torchrun's "exitcode: -9" stays true)."""
    if signum != signal.SIGKILL:
        signal.signal(signum, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signum)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    return 128 + signum  # not reached for a fatal signal


def read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """As the zygote: an entry's request and its three fds (ValueError, fds closed, if it is not one)."""
    data, ancillary, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(3 * 4))
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) - len(payload) % 4]))
    try:
        if len(data) < LEN.size or len(fds) != 3:
            raise ValueError(f"expected a length and 3 fds, got {len(data)} bytes and {len(fds)} fds")
        (size,) = LEN.unpack(data[: LEN.size])
        body = data[LEN.size :]
        while len(body) < size:
            more = conn.recv(size - len(body))
            if not more:
                raise ValueError("request cut short")
            body += more
        return json.loads(body), fds
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise


def take_place(conn: socket.socket, request: dict[str, Any], fds: list[int], watch_name: str) -> threading.Event:
    """In the forked child: take the entry's place (own session, its fds, cwd and environment), tell the
    entry this pid, and die at once if the entry dies before :func:`finish` (EOF on ``conn``: the entry
    was SIGKILLed, and a process nobody waits for must not go on). Returns the event :func:`finish` sets."""
    os.setsid()  # the entry relays its signals; a group-wide one must not reach this child twice
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _leave_zygote_finalizers()
    conn.sendall(REC.pack(b"P", os.getpid()))
    done = threading.Event()

    def entry_gone() -> None:
        try:
            conn.recv(1)  # the entry sends nothing after its request
        except OSError:
            pass
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=entry_gone, name=watch_name, daemon=True).start()
    return done


def _leave_zygote_finalizers() -> None:
    """The ``weakref.finalize`` callbacks registered before the fork clean up after the zygote (torch's operator
    registrations: 40-60 ms at a command's exit); the child's exit runs only its own. One the zygote needs
    (a temporary directory's removal) must not run when a child ends either."""
    for f in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        f.atexit = False


def differing_interpreter_vars(env: Mapping[str, str], ignored: frozenset[str] = frozenset()) -> list[str]:
    """As a zygote: the ``PYTHON*`` variables (read as an interpreter starts) set otherwise in ``env`` than in this
    process's environment, but ``ignored``: a forked child of this interpreter would not have ``env``'s."""
    theirs = {(k, v) for k, v in env.items() if k.startswith("PYTHON") and k not in ignored}
    ours = {(k, v) for k, v in os.environ.items() if k.startswith("PYTHON") and k not in ignored}
    return sorted({k for k, _ in theirs ^ ours})


def refuse(conn: socket.socket, fds: list[int]) -> None:
    """As the zygote: fork nothing for this request; its entry starts the process cold."""
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(REC.pack(b"R", 0))
    except OSError:
        pass  # the entry is gone
    conn.close()


def std_streams() -> None:
    """In the forked child: sys.stdin/stdout/stderr anew on fds 0-2, which are the entry's now. The zygote's were
    made for its own (a log file: block-buffered); a terminal's stdout is line-buffered and stderr always is, as in
    a process started cold."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        line = fd == 2 or (fd == 1 and os.isatty(1))
        stream = open(  # noqa: SIM115 - the process's own standard stream, open until it ends
            fd,
            "r" if fd == 0 else "w",
            buffering=1 if line else -1,
            encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None),
            closefd=False,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def exit_code(e: SystemExit) -> int:
    """The status an interpreter ends with for ``e``."""
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def run_and_finish(conn: socket.socket, done: threading.Event, body: Callable[[], int]) -> NoReturn:
    """In the forked child: run ``body`` as an interpreter runs its main module (its ``SystemExit``'s code; an
    uncaught exception printed, status 1), then what interpreter shutdown does before a process ends (non-daemon
    threads waited for, the atexit handlers: Prefect's log and event workers flush there), and :func:`finish`."""
    try:
        code = int(body())
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends an interpreter: traceback, status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    finish(conn, done, code)


def finish(conn: socket.socket, done: threading.Event, code: int) -> NoReturn:
    """In the forked child: tell the entry the exit status and end with it.

    The entry's standard streams are closed here first: a process holds its descriptors until the kernel has taken
    its memory apart, which for a child of a large engine takes tens of milliseconds, and whoever reads the
    entry's output to its end (a shell's command substitution, a caller's pipe) would wait for that too."""
    done.set()
    sys.stdout.flush()
    sys.stderr.flush()
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            os.close(fd)
    try:
        conn.sendall(REC.pack(b"X", code))
    except OSError:
        pass  # the entry is gone; nobody is left to tell
    os._exit(code)
