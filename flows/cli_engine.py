"""`traingate run`, `resume` and `sweep` forked from a warm process kept beside the kept Prefect server.

A cold `traingate run` spends 2-3 CPU-s before its flow starts: Python, Prefect, MLflow with SQLAlchemy and pandas,
the ladder's modules. Beside the kept server (:mod:`flows.local_server`) traingate keeps a CLI engine that imported
all of that once and forks one command per request. The `traingate` command asks it first
(:mod:`flows.cli_forward`, all the command imports before) for `run`, `resume` and `sweep` when the kept server is
the one in use (no ``PREFECT_API_URL`` of the user's, ``TRAINGATE_PREFECT_SERVER`` kept): it hands the engine its
argv, environment, working directory and stdin/stdout/stderr (SCM_RIGHTS, :mod:`traingate.runtime.handoff`); the
forked child takes them (its own session), runs ``flows.cli.main(argv)`` (whose :func:`flows.local_server.connect`
reads Prefect's settings again from the command's environment, and configures its logging again where what that is
made from differs from the engine's) and its atexit handlers.
The command relays SIGINT (Ctrl-C preempts the running stage at a checkpoint, as in a cold command) and SIGTERM
to the child and ends as the child ended.

The command runs cold, in its own process, with ``TRAINGATE_CLI_ENGINE=off``, when no engine answers, or when
the engine refuses: its code on disk
changed since it imported it (the engine then ends, and the next cold command starts a new one), the command
runs another interpreter or another checkout, or the command's ``PYTHON*`` variables (read at interpreter
start) differ from the engine's. A cold one of these commands that used the kept server starts an
engine as it ends (:func:`ensure`), detached; the engine serves while the kept server it belongs to
runs, and `traingate server stop` ends both. Its files sit in the server's directory (mode 0700):
``engine.json`` (pid, socket, the server's pid), ``engine.log`` and ``engine.lock`` (held for its life: one
engine per server). The socket is in a private temporary directory (0700: only this user may ask for a
fork; a state directory's path may be too long for a unix socket's 107 bytes).

A built-in recipe's unit stage asks the same engine to fork its tests (:mod:`traingate.launch.pytest_child`,
``TRAINGATE_ENGINE_SOCKET`` in a forked command's environment): the engine holds pytest and the contract tests'
imports too.

The request (:mod:`traingate.runtime.handoff`'s wire format) is ``{argv, env, cwd, python, code, path0}``, or a
pytest run's (:mod:`traingate.launch.pytest_child`).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from flows import local_server, warm_engine
from flows.cli_forward import RECORD, read_record, wanted
from traingate.launch import pytest_child
from traingate.runtime import handoff
from traingate.settings import ENGINE_SOCKET_VAR, Settings

LOG = "engine.log"
LOCK = "engine.lock"
# What a cold run, resume or sweep imports before and while its flow runs: the CLI and its commands, the flows
# (Prefect's engines, MLflow, pandas), MLflow's SQL stores with their migrations and SQLite dialect (imported on
# a store's first use: about 1 CPU-s), and torch (a built-in recipe's data snapshot).
PRELOADED = (
    "flows.cli",
    "flows.cli.command",
    "flows.cli.run",
    "flows.cli.resume",
    "flows.cli.sweep",
    "prefect.flow_engine",
    "prefect.task_engine",
    # What Prefect's settings were read from and its logging configured from as it was imported: a command with the
    # same keeps them.
    "flows.local_server:note_prefect_setup",
    "prefect.utilities.visualization",
    "prefect.concurrency.services",
    "anyio._backends._asyncio",
    "mlflow.store.tracking.sqlalchemy_workspace_store",
    "mlflow.store.model_registry.sqlalchemy_workspace_store",
    "alembic.command",
    "sqlalchemy.dialects.sqlite",
    "torch",
    # The installed packages a run's environment snapshot lists, read once (they are read again when sys.path changes).
    "traingate.tracking.identity:installed_packages",
    # What opening an MLflow store computes the same way in every child (traingate.tracking.runs.warm_mlflow).
    "traingate.tracking.runs:warm_mlflow",
    "flows.warm_engine:build_prefect_models",
    "flows.prefect_tls:share",  # a forked command's Prefect clients make no TLS context of their own
    # A built-in recipe's unit stage is forked from the engine too (traingate.launch.pytest_child).
    "pytest",
    *pytest_child.CONTRACT_PRELOAD,
)


def ensure(state_dir: Path) -> None:
    """After a cold command that used the kept server: start an engine for that server unless one serves it."""
    if not os.environ.get("PREFECT_API_URL") or not wanted():
        return  # the command used no server, or Prefect's temporary one
    server = local_server.status(state_dir)
    if server is None or os.environ["PREFECT_API_URL"] != server.api_url:
        return  # the command used another server
    d = local_server.server_dir(state_dir)
    record = read_record(d)
    if record is not None and record.get("server_pid") == server.pid:
        return
    home = tempfile.mkdtemp(prefix="tg-cli-engine-")  # 0700
    env = dict(os.environ)
    # Forking needs a single-threaded engine; torch's OpenMP pool starts at import when the count is unset. Only
    # the engine's own environment: its children take their command's.
    env.setdefault("OMP_NUM_THREADS", "1")
    # Nobody's descendant (as the kept server): the guardian of the command starting it stops that command's
    # descendants once the command has ended.
    local_server.detached(
        [sys.executable, "-m", "flows.cli_engine", "--serve", os.path.join(home, "sock"), str(server.pid)],
        d / LOG,
        env,
        cwd=warm_engine.CODE_ROOT,
    )


def stop(state_dir: Path) -> None:
    """End the engine of the kept server in ``state_dir``, if one runs (it also ends with its server)."""
    record = read_record(local_server.server_dir(state_dir))
    if record is not None:
        try:
            os.kill(int(record["pid"]), signal.SIGTERM)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


# ---------------------------------------------------------------- the engine


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "--serve" and argv[2].isdigit():
        return serve(argv[1], int(argv[2]))
    print("python -m flows.cli_engine: usage: --serve SOCKET SERVER_PID (started by traingate)", file=sys.stderr)
    return 64


def serve(path: str, server_pid: int) -> int:
    """Bind ``path``, import the command stack once, then fork a command per request while the kept server
    ``server_pid`` of this state directory runs. The socket is bound before the imports: a command that arrives
    meanwhile waits in the backlog instead of starting cold beside the importing engine."""
    state_dir = Settings.from_env().state_dir
    d = local_server.server_dir(state_dir)
    lock = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("cli engine: another engine serves this server; not serving", file=sys.stderr, flush=True)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener, wake = warm_engine.listen(path)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    _write_record(d, {"pid": os.getpid(), "socket": path, "server_pid": server_pid})
    started = time.time()
    why = None
    warm_engine.preload(PRELOADED, "cli engine")
    if extra := warm_engine.extra_threads():
        why = f"threads {extra} after the imports"
    code = warm_engine.code_files()
    print(
        f"cli engine: {'not serving: ' + why if why else 'ready'} on {path} (pid {os.getpid()}) for the server "
        f"{server_pid}, imports {time.time() - started:.2f} s, {time.process_time():.2f} CPU-s",
        file=sys.stderr,
        flush=True,
    )
    children: dict[int, socket.socket] = {}
    # One that cannot fork stays, refusing: a command then runs cold at once, and no later one starts another engine.
    refusing = why
    why = None
    while why is None and not stopping and _server_runs(d, server_pid):
        ready, _, _ = select.select([listener.fileno(), wake[0]], [], [], 0.5)
        if wake[0] in ready:
            warm_engine.drain(wake[0])
        if listener.fileno() in ready:
            conn, _ = listener.accept()
            why = _fork_command(conn, listener, wake, children, code, refusing)
        warm_engine.reap(children)
    print(f"cli engine: ending: {why or ('stopped' if stopping else 'its server ended')}", file=sys.stderr, flush=True)
    listener.close()
    if (mine := read_record(d)) is not None and mine.get("pid") == os.getpid():
        (d / RECORD).unlink(missing_ok=True)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return 0


def _write_record(d: Path, record: dict) -> None:
    tmp = d / f".{RECORD}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, d / RECORD)


def _server_runs(d: Path, server_pid: int) -> bool:
    try:
        os.kill(server_pid, 0)
        return json.loads((d / local_server.RECORD).read_text())["pid"] == server_pid
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _refusal(request: dict, code: dict[str, tuple[int, int]]) -> tuple[str | None, bool]:
    """Why the engine does not fork ``request`` (None: it does), and whether it is to end for it."""
    if changed := warm_engine.changed_file(code):
        return f"{changed} changed since it was imported", True
    if pytest_child.KIND in request:
        return pytest_child.refusal(request), False
    if request.get("python") != sys.executable or request.get("code") != str(warm_engine.CODE_ROOT):
        return f"the command runs {request.get('python')} on {request.get('code')}, not this engine's code", False
    if differ := handoff.differing_interpreter_vars(request["env"]):
        return f"the command's {differ} differ from the engine's (read at interpreter start)", False
    return None, False


def _fork_command(
    conn: socket.socket,
    listener: socket.socket,
    wake: tuple[int, int],
    children: dict[int, socket.socket],
    code: dict[str, tuple[int, int]],
    refusing: str | None,
) -> str | None:
    """Fork the command asked for on ``conn``, or refuse it (it runs cold); why the engine is to end, if it is.
    ``refusing``: why this engine forks nothing, if it does not."""
    if (asked := warm_engine.read_request(conn, "cli engine")) is None:
        return None
    request, fds = asked
    pytest_run = pytest_child.KIND in request
    why, end = (refusing, False) if refusing else _refusal(request, code)
    if why is not None:
        print(f"cli engine: a command runs cold: {why}", file=sys.stderr, flush=True)
        handoff.refuse(conn, fds)
        return why if end else None
    engine = listener.getsockname()
    pid = os.fork()
    if pid == 0:
        try:
            warm_engine.as_child(listener, wake, children)
            if pytest_run:
                pytest_child.forked(conn, request, fds)  # ends in os._exit
            _become_command(conn, request, fds, engine)  # ends in os._exit
        finally:
            os._exit(70)  # an exception escaped the child's own handling (EX_SOFTWARE)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    what = "a unit stage's tests" if pytest_run else f"`traingate {request['argv'][0]}`"
    print(f"cli engine: forked {pid} for {what}", file=sys.stderr, flush=True)
    return None


def _become_command(conn: socket.socket, request: dict, fds: list[int], engine: str) -> None:
    """In the forked child: take the command's place (session, fds, environment, cwd) and run it; its unit stage
    asks ``engine`` (this engine's socket) to fork its tests."""
    # A command whose `traingate` process was SIGKILLed ends with it: nobody waits for its output.
    done = handoff.take_place(conn, request, fds, "cli-entry-watch")
    os.environ[ENGINE_SOCKET_VAR] = engine
    handoff.std_streams()
    sys.argv = ["traingate", *request["argv"]]
    sys.path[0] = request["path0"]
    torch = sys.modules["torch"]
    if (threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    handoff.run_and_finish(conn, done, lambda: sys.modules["flows.cli"].main(request["argv"]))


if __name__ == "__main__":
    sys.exit(main())
