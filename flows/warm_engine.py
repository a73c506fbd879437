"""A process pool's flow runs forked from a pre-imported parent instead of started cold.

A process worker starts each flow run as ``python -m prefect.engine``: Python, Prefect, the ladder's
module (MLflow and pandas with it) and, for a built-in recipe's data snapshot, torch; 5-6 CPU-s, on the
path from a UI trigger to the first training step. Started as the worker's wrapper::

    python -m flows.warm_engine --worker prefect worker start --pool cpu-local --type process

this module starts a zygote beside the worker (``--serve``), which imports all of that once, and execs the
worker with ``TRAINGATE_ENGINE_SOCKET`` naming the zygote's socket. The pool's command
(``traingate pools bootstrap`` writes it into a process pool's job template) is the thin entry
``python -m flows.warm_engine``: it hands the zygote its environment, working directory and
stdin/stdout/stderr (SCM_RIGHTS); the forked child takes them (its own session), refreshes Prefect's
settings and logging from that environment and runs ``prefect.engine`` as ``python -m prefect.engine``
would, atexit handlers included. The entry relays SIGTERM and SIGINT to the child and ends as it ended
(a death by a signal re-raised as the same signal), so the worker sees the flow run's process as it would
see a cold one. A child whose entry is gone (SIGKILLed) kills itself.

The entry starts cold (``exec python -m prefect.engine``) when no zygote answers, when the request's
``TRAINGATE_CODE_DIR`` is not the code the zygote imported, and when a file of that code changed since the
zygote imported it; on a changed file the zygote also restarts itself, so the next flow run is warm on
the new code. A zygote serves only its own worker (the socket sits in a directory only its user can
enter) and ends when the worker does.

The request (:mod:`traingate.runtime.handoff`'s wire format) is ``{env, cwd}``.
"""

from __future__ import annotations

import gc
import importlib
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from traingate import commandenv
from traingate.launch import pytest_child
from traingate.runtime import handoff
from traingate.settings import CODE_DIR_VAR, ENGINE_SOCKET_VAR

# What a cold flow-run process of the ladder imports before its first task: Prefect's engine, the flows
# (MLflow, pandas, the tasks and the core library with them) and torch (a built-in recipe's data snapshot).
# A built-in recipe's unit stage is forked from it too (traingate.launch.pytest_child): pytest and the contract tests'
# imports.
PRELOADED = (
    "prefect.engine",
    "flows.pipeline",
    "flows.stage",
    "torch",
    "pytest",
    *pytest_child.CONTRACT_PRELOAD,
    "traingate.tracking.identity:installed_packages",  # a run's environment snapshot lists them
    "traingate.tracking.runs:warm_mlflow",  # what opening an MLflow store computes the same way in every child
    "flows.warm_engine:build_prefect_models",
    "flows.prefect_tls:share",  # a forked command's Prefect clients make no TLS context of their own
)
# Threads a library starts at import that hold no lock a forked child could need (jemalloc's arena purger,
# through pyarrow under pandas, re-creates itself in a child).
_FORK_SAFE_THREADS = {"jemalloc_bg_thd"}
CODE_ROOT = commandenv.CODE_ROOT
# A process pool's command (its job template's default): this module's thin entry.
ENGINE_COMMAND = "python -m flows.warm_engine"


# ---------------------------------------------------------------- thin entry (the pool's command)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"] and len(argv) == 3:
        return serve(argv[1], int(argv[2]))
    if argv[:1] == ["--worker"] and len(argv) > 1:
        return worker(argv[1:])
    if argv:
        print(
            "python -m flows.warm_engine: usage: (no arguments: run the flow run of PREFECT__FLOW_RUN_ID), "
            "--worker COMMAND..., --serve SOCKET WORKER_PID",
            file=sys.stderr,
        )
        return 64
    return handoff.ask(os.environ.get(ENGINE_SOCKET_VAR), {"env": dict(os.environ), "cwd": os.getcwd()}, _cold)


def _cold() -> int:
    """Become ``python -m prefect.engine``, the command a process worker runs by default (same pid)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "prefect.engine"])
    return 70  # not reached: execv returns only by raising


# ---------------------------------------------------------------- the worker's wrapper


def worker(command: list[str]) -> int:
    """Start a zygote, then become ``COMMAND`` (exec: same pid, so the worker's signals and exit are its own)
    with the zygote's socket in its environment, which its flow runs inherit."""
    home = tempfile.mkdtemp(prefix="tg-engine-")  # 0700: only this user reaches the socket
    path = os.path.join(home, "zygote.sock")
    env = dict(os.environ)
    # A zygote must be single-threaded when it forks; torch's OpenMP pool starts at import when the count is
    # unset. Only the zygote's own environment: its children take their entry's.
    subprocess.Popen(
        [sys.executable, "-m", "flows.warm_engine", "--serve", path, str(os.getpid())],
        env={**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")},
        stdin=subprocess.DEVNULL,
        cwd=str(CODE_ROOT),
    )
    env[ENGINE_SOCKET_VAR] = path
    os.execvpe(command[0], command, env)
    return 70  # not reached


# ---------------------------------------------------------------- zygote


def serve(path: str, worker_pid: int) -> int:
    """Bind ``path``, import the flow-run stack once, then fork a flow run per request while ``worker_pid``
    (this zygote's parent) lives. The socket is bound before the imports: an entry that arrives meanwhile
    waits in the backlog instead of starting cold beside the importing zygote."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C stops the worker; this ends with it
    if os.path.exists(path):
        os.unlink(path)  # a restart on changed code (its own socket)
    listener, wake = listen(path)
    started = time.time()
    preload(PRELOADED, "flow-run zygote")
    extra = extra_threads()
    if extra:
        print(f"flow-run zygote: threads {extra} after the imports; not serving, flow runs start cold", file=sys.stderr)
        listener.close()
        os.unlink(path)
        return 3
    code = code_files()
    print(
        f"flow-run zygote: ready on {path} (pid {os.getpid()}), imports {time.time() - started:.2f} s, "
        f"{time.process_time():.2f} CPU-s, {len(code)} code files watched",
        file=sys.stderr,
        flush=True,
    )
    children: dict[int, socket.socket] = {}
    while os.getppid() == worker_pid:
        ready, _, _ = select.select([listener.fileno(), wake[0]], [], [], 0.5)
        if wake[0] in ready:
            drain(wake[0])
        if listener.fileno() in ready:
            conn, _ = listener.accept()
            changed = _fork_flow_run(conn, listener, wake, children, code)
            if changed:  # the code on disk is not what this zygote imported: start again on the new code
                listener.close()
                reap(children)
                os.execv(sys.executable, [sys.executable, "-m", "flows.warm_engine", "--serve", path, str(worker_pid)])
        reap(children)
    listener.close()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return 0


def listen(path: str) -> tuple[socket.socket, tuple[int, int]]:
    """An engine's socket, bound at ``path`` and listening, and its self-pipe, which SIGCHLD wakes its loop through
    (read end, write end)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake = os.pipe()
    for fd in wake:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    return listener, wake


# Prefect's client schemas, artifacts and events: a flow run creates, sends and reads them.
PREFECT_MODELS = ("prefect.client.schemas", "prefect.artifacts", "prefect.events.schemas")


def build_prefect_models() -> None:
    """Prefect's models build their validators on first use (pydantic's deferred build): once here, not in each
    forked command (a flow run's creation alone builds three, about 10 ms)."""
    from pydantic import BaseModel  # lazy: the pool's thin entry imports this module, and it needs no pydantic

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(PREFECT_MODELS):
            continue
        for value in list(vars(module).values()):
            if (
                isinstance(value, type)
                and issubclass(value, BaseModel)
                and value.__module__ == name
                and not value.__pydantic_complete__
            ):
                value.model_rebuild()


def preload(names: tuple[str, ...], who: str) -> None:
    """Import ``names`` once, before any fork; a name ``module:function`` also calls that function (no arguments),
    to fill a cache every forked child inherits. The imports make objects and no garbage: no collection runs
    during them, and frozen after them no later collection walks them. A module that is not there (a library
    moved it) is said and skipped: a forked child imports what it needs itself."""
    gc.disable()
    for name in names:
        module, _, function = name.partition(":")
        try:
            loaded = importlib.import_module(module)
        except ImportError as e:
            print(f"{who}: not preloaded: {name}: {e}", file=sys.stderr, flush=True)
            continue
        if function:
            try:
                getattr(loaded, function)()
            except Exception as e:  # noqa: BLE001 - a cache not filled: the child fills it, as a cold process does
                print(f"{who}: not preloaded: {name}: {e!r}", file=sys.stderr, flush=True)
    gc.freeze()
    gc.enable()


def read_request(conn: socket.socket, who: str) -> tuple[dict, list[int]] | None:
    """An entry's request and fds (10 s to send them), or None (said, ``conn`` closed) when it sent none."""
    conn.settimeout(10.0)
    try:
        request, fds = handoff.read_request(conn)
    except (OSError, ValueError) as e:
        print(f"{who}: bad request: {e}", file=sys.stderr, flush=True)
        conn.close()
        return None
    conn.settimeout(None)
    return request, fds


def extra_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == os.getpid():
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name not in _FORK_SAFE_THREADS:
            names.append(name)
    return names


def code_files() -> dict[str, tuple[int, int]]:
    """(mtime, size) of every imported module file of this checkout: what a forked flow run would run."""
    out = {}
    root = str(CODE_ROOT) + os.sep
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and file.startswith(root) and os.sep + ".venv" + os.sep not in file:
            try:
                st = os.stat(file)
            except OSError:
                continue
            out[file] = (st.st_mtime_ns, st.st_size)
    return out


def changed_file(code: dict[str, tuple[int, int]]) -> str | None:
    for file, seen in code.items():
        try:
            st = os.stat(file)
        except OSError:
            return file
        if (st.st_mtime_ns, st.st_size) != seen:
            return file
    return None


def drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 512):
                return
        except BlockingIOError:
            return


def _fork_flow_run(
    conn: socket.socket,
    listener: socket.socket,
    wake: tuple[int, int],
    children: dict[int, socket.socket],
    code: dict[str, tuple[int, int]],
) -> bool:
    """Fork a flow run for the request on ``conn`` or refuse it (the entry starts cold); True when a file of the
    imported code changed."""
    if (asked := read_request(conn, "flow-run zygote")) is None:
        return False
    request, fds = asked
    code_dir = request["env"].get(CODE_DIR_VAR)
    changed = changed_file(code)
    pytest_run = pytest_child.KIND in request
    why = None
    if changed:
        why = f"{changed} changed since it was imported"
    elif pytest_run:
        why = pytest_child.refusal(request)
    elif not code_dir or Path(code_dir).resolve() != CODE_ROOT:
        why = f"{CODE_DIR_VAR}={code_dir!r} is not {CODE_ROOT}, the code it imported"
    elif differ := handoff.differing_interpreter_vars(request["env"]):
        # PYTHONPATH and the like act when an interpreter starts: the zygote's, not the flow run's, made this one.
        why = f"the flow run's {differ} differ from the zygote's (read at interpreter start)"
    if why:
        what = "a unit stage's tests start" if pytest_run else "a flow run starts"
        print(f"flow-run zygote: {what} cold: {why}", file=sys.stderr, flush=True)
        handoff.refuse(conn, fds)
        return changed is not None
    pid = os.fork()
    if pid == 0:
        try:
            as_child(listener, wake, children)
            if pytest_run:
                pytest_child.forked(conn, request, fds)  # ends in os._exit
            _become_flow_run(conn, request, fds)  # ends in os._exit
        finally:
            os._exit(70)  # an exception escaped the child's own handling (EX_SOFTWARE)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    what = "a unit stage's tests" if pytest_run else "flow run"
    print(
        f"flow-run zygote: forked {pid} for {what} {request['env'].get('PREFECT__FLOW_RUN_ID')}",
        file=sys.stderr,
        flush=True,
    )
    return False


def as_child(listener: socket.socket, wake: tuple[int, int], children: dict[int, socket.socket]) -> None:
    """In an engine's forked child: the engine's socket, pipes and signal handling let go of."""
    listener.close()
    for other in children.values():
        other.close()
    signal.set_wakeup_fd(-1)
    for fd in wake:
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _become_flow_run(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: take the entry's place (session, fds, environment, cwd) and run the flow run."""
    # An entry SIGKILLed by the worker takes the flow run with it: a flow run nobody waits for must not go on.
    done = handoff.take_place(conn, request, fds, "engine-entry-watch")
    sys.argv = [sys.argv[0]]
    # Prefect read its settings and set up logging from the zygote's environment at import; a cold process
    # reads the flow run's.
    sys.modules["prefect.context"].refresh_global_settings_context()
    sys.modules["prefect.logging.configuration"].setup_logging(incremental=False)
    torch = sys.modules["torch"]
    if (threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    # Run as `-m` runs it: a fresh __main__ from the module's code (its imports stay loaded); runpy warns when the
    # module it runs is in sys.modules already (Prefect's own workspace bootstrap does the same).
    sys.modules.pop("prefect.engine", None)

    def engine() -> int:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        return 0

    handoff.run_and_finish(conn, done, engine)


def reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        if os.WIFSIGNALED(status):  # a child that exited has said so itself; a signal it could not report
            try:
                conn.sendall(handoff.REC.pack(b"S", os.WTERMSIG(status)))
            except OSError:
                pass
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
