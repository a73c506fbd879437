"""The local Prefect server traingate keeps for its user: started by the first command that needs one,
reused by every later command, stopped by `traingate server stop`.

A temporary Prefect server costs every `traingate run` its start (about 15 s on a loaded 2-core box); a
kept server costs a later command a health check. Which one a command uses:

- ``PREFECT_API_URL`` set: that server, always.
- ``TRAINGATE_PREFECT_SERVER=temporary`` (the default when ``CI`` is set): Prefect's temporary server,
  started and stopped with the command, as CI wants (no process outlives the job, no state is shared).
- otherwise (``kept``): this module's server.

Every one of them authenticates its clients. A temporary server is started by Prefect in this process's
environment, so :func:`authenticate_temporary` puts a generated auth string there first, for the server
(``PREFECT_SERVER_API_AUTH_STRING``) and for the clients of this process and its children
(``PREFECT_API_AUTH_STRING``); it is never printed or written.

The kept server authenticates its clients as the production stack's does (``PREFECT_SERVER_API_AUTH_STRING``
on the server, ``PREFECT_API_AUTH_STRING`` on each client, CSRF protection on, Secret blocks encrypted with
a key of its own) and listens on loopback on a free port. Its files, under ``<state dir>/prefect-server/``
(mode 0700, every file 0600): ``server.json`` (the record: pid, process group, port; no secret),
``secrets.env`` (the auth string and the encryption key), ``prefect.db``, ``server.log`` and ``lock``.
Commands that check, start or stop the server hold ``lock`` (flock), so two commands starting at once
end up with one server. A record whose process is gone, is another process, or does not answer with
the auth string is stale: its process group is stopped and a new server started.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

import psutil

from traingate.settings import PREFECT_SERVER_VAR

MODE_VAR = PREFECT_SERVER_VAR
DIR_NAME = "prefect-server"
RECORD = "server.json"
SECRETS = "secrets.env"
LOG = "server.log"
LOCK = "lock"
AUTH_VAR = "PREFECT_SERVER_API_AUTH_STRING"
CLIENT_AUTH_VAR = "PREFECT_API_AUTH_STRING"
KEY_VAR = "PREFECT_SERVER_ENCRYPTION_KEY"
# A loaded 2-core machine takes 5-20 s to bring a Prefect server up; 180 s leaves room for a much busier one.
START_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
ANSWER_PATIENCE_S = 60.0  # how long a running server may fail its health check before it counts as hung
START_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it


class Mode(StrEnum):
    KEPT = "kept"
    TEMPORARY = "temporary"


class LocalServerError(RuntimeError):
    """The kept server cannot be used: one line naming what failed and where to look."""


@dataclass(frozen=True)
class Record:
    """What ``server.json`` holds: enough to find, check and stop the server, and no secret."""

    pid: int
    pgid: int
    port: int
    started_at: float  # the process's start time (psutil): a recycled pid has another one

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def mode(env: Mapping[str, str] | None = None) -> Mode:
    """The ``TRAINGATE_PREFECT_SERVER`` setting; unset: ``temporary`` under CI (``CI`` set), else ``kept``.

    >>> mode({}).value, mode({"CI": "true"}).value, mode({"CI": "true", MODE_VAR: "kept"}).value
    ('kept', 'temporary', 'kept')
    """
    env = os.environ if env is None else env
    value = env.get(MODE_VAR, "").strip().lower()
    if not value:
        return Mode.TEMPORARY if env.get("CI", "").strip().lower() not in ("", "0", "false", "no") else Mode.KEPT
    try:
        return Mode(value)
    except ValueError:
        raise LocalServerError(
            f"{MODE_VAR} = {value!r}: not a server mode; use one of {[m.value for m in Mode]} "
            "(or set PREFECT_API_URL to use a server of your own)"
        ) from None


def authenticate_temporary(env: MutableMapping[str, str] | None = None) -> None:
    """Make the temporary server Prefect may start for this process demand an auth string, and its clients
    send it: with no ``PREFECT_API_URL``, ``PREFECT_SERVER_API_AUTH_STRING`` (the environment's, else one
    generated now) and ``PREFECT_API_AUTH_STRING`` set to it. Call it before anything imports Prefect.

    Prefect starts its temporary server with this process's environment; children inherit the client's
    variable, and the redactor masks both wherever a log would show them (their names say ``AUTH``).

    >>> env = {}
    >>> authenticate_temporary(env)
    >>> env[AUTH_VAR] == env[CLIENT_AUTH_VAR] and env[AUTH_VAR].startswith("traingate:")
    True
    >>> env = {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    >>> authenticate_temporary(env); env  # another server: its own auth string is the user's to give
    {'PREFECT_API_URL': 'http://127.0.0.1:4200/api'}
    """
    env = os.environ if env is None else env
    if env.get("PREFECT_API_URL"):
        return
    auth = env.get(AUTH_VAR) or f"traingate:{secrets.token_hex(16)}"
    env[AUTH_VAR] = auth
    env[CLIENT_AUTH_VAR] = auth
    env.pop("PREFECT_API_KEY", None)  # it wins over the auth string and breaks it


def server_dir(state_dir: Path) -> Path:
    return state_dir / DIR_NAME


def connect(state_dir: Path) -> Record | None:
    """Point this process's Prefect client at the kept server (started now if none is running) and return
    its record; None where the setting or ``PREFECT_API_URL`` says another server is used.

    Call it before anything imports Prefect: Prefect reads its settings from the environment at import.
    """
    if os.environ.get("PREFECT_API_URL") or mode() is Mode.TEMPORARY:
        return None
    assert "prefect" not in sys.modules, "connect() after Prefect was imported: its client keeps its old settings"
    record, started = ensure(state_dir)
    os.environ["PREFECT_API_URL"] = record.api_url
    os.environ[CLIENT_AUTH_VAR] = _secrets(server_dir(state_dir))[AUTH_VAR]
    os.environ.pop(AUTH_VAR, None)  # a temporary server's (authenticate_temporary): no server of this process
    os.environ.pop("PREFECT_API_KEY", None)  # it wins over the auth string and breaks it
    if started:
        print(
            f"traingate: started a local Prefect server at {record.ui_url} (pid {record.pid}), kept for later "
            "commands; `traingate server stop` stops it",
            file=sys.stderr,
            flush=True,
        )
    return record


def ui_hint(state_dir: Path) -> str:
    """Where this command's runs are seen in Prefect's UI, for the closing lines of run, resume and sweep."""
    url = os.environ.get("PREFECT_API_URL")
    if not url:  # the temporary server is gone: a server on the same database shows its runs
        return f"PREFECT_HOME={os.environ.get('PREFECT_HOME', '')} prefect server start"
    d = server_dir(state_dir)
    record = _read_record(d)
    if record is not None and record.api_url == url:
        return f"{record.ui_url} (log in with the auth string in {d / SECRETS})"
    return url.removesuffix("/api")


def ensure(state_dir: Path) -> tuple[Record, bool]:
    """The running kept server's record, starting one (and replacing a stale record) when none answers.

    Returns the record and whether this call started the server.
    """
    d = server_dir(state_dir)
    with _locked(d):
        record = _live_record(d)
        if record is not None:
            return record, False
        return _start(d), True


def status(state_dir: Path) -> Record | None:
    """The kept server's record if it is running and answers with its auth string, else None."""
    d = server_dir(state_dir)
    if not (d / RECORD).exists():
        return None
    with _locked(d):
        return _live_record(d)


def stop(state_dir: Path) -> Record | None:
    """Stop the kept server (its whole process group) and remove its record; the record stopped, or None."""
    d = server_dir(state_dir)
    if not (d / RECORD).exists():
        return None
    with _locked(d):
        record = _read_record(d)
        if record is None:
            return None
        _stop_group(record)
        (d / RECORD).unlink(missing_ok=True)
        return record


def alive_in_group(pgid: int) -> list[psutil.Process]:
    """The running processes (a zombie is not) of process group ``pgid`` that are a Prefect server's: a
    recycled group id of another program is never touched."""
    out = []
    for p in psutil.process_iter(["status", "cmdline"]):
        try:
            if (
                p.info["status"] != psutil.STATUS_ZOMBIE
                and os.getpgid(p.pid) == pgid
                and any("prefect" in a or "uvicorn" in a for a in p.info["cmdline"] or ())
            ):
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


# ---------------------------------------------------------------- the record, the secrets, the lock


@contextmanager
def _locked(d: Path) -> Iterator[None]:
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, or when a killed holder's fds are closed
        yield
    finally:
        os.close(fd)


def _read_record(d: Path) -> Record | None:
    try:
        return Record(**json.loads((d / RECORD).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):  # a torn or foreign file: no server can be found through it
        (d / RECORD).unlink(missing_ok=True)
        return None


def _write_record(d: Path, record: Record) -> None:
    tmp = d / f".{RECORD}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(record), f)
    os.replace(tmp, d / RECORD)


def _secrets(d: Path) -> dict[str, str]:
    """The server's auth string and encryption key, generated once into a 0600 file."""
    path = d / SECRETS
    if not path.exists():
        values = {
            AUTH_VAR: f"traingate:{secrets.token_hex(16)}",
            KEY_VAR: base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),  # a Fernet key
        }
        tmp = d / f".{SECRETS}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in values.items()))
        os.replace(tmp, path)
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def _live_record(d: Path) -> Record | None:
    """The record if its server runs and answers with the auth string; a stale one is stopped and removed."""
    record = _read_record(d)
    if record is None:
        return None
    auth = _secrets(d)[AUTH_VAR]
    # A running server that is slow to answer (a loaded machine) is asked again before it is given up:
    # replacing it would break the commands using it.
    deadline = time.monotonic() + ANSWER_PATIENCE_S
    while _is_our_process(record):
        if _answers(record, auth):
            return record
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    _stop_group(record)
    (d / RECORD).unlink(missing_ok=True)
    return None


def _is_our_process(record: Record) -> bool:
    """Whether the record's pid still runs the process it recorded: same start time, a Prefect server."""
    try:
        p = psutil.Process(record.pid)
        return (
            p.status() != psutil.STATUS_ZOMBIE
            and abs(p.create_time() - record.started_at) < 1.0
            and any("prefect" in a for a in p.cmdline())
        )
    except psutil.Error:
        return False


def _answers(record: Record, auth: str, timeout: float = 5.0) -> bool:
    """Whether the server at the record's port is healthy and accepts the auth string (so it is ours)."""
    token = base64.b64encode(auth.encode()).decode()
    try:
        with urllib.request.urlopen(f"{record.api_url}/health", timeout=timeout) as r:
            if r.status != 200:
                return False
        req = urllib.request.Request(f"{record.api_url}/admin/version", headers={"Authorization": f"Basic {token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


# ---------------------------------------------------------------- start and stop


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_env(d: Path, port: int, values: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(d),
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{d / 'prefect.db'}",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_CSRF_PROTECTION_ENABLED="true",
        PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api",  # else the UI calls :4200
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_LOGGING_LEVEL="WARNING",
        **{AUTH_VAR: values[AUTH_VAR], CLIENT_AUTH_VAR: values[AUTH_VAR], KEY_VAR: values[KEY_VAR]},
    )
    return env


# The server's own session (a terminal's Ctrl-C does not reach it) and no parent among traingate's
# processes: the shell exits at once, so the server is nobody's descendant (a CLI's guardian, which stops
# the descendants of a dead CLI, never sees it). umask 077: the database and logs it creates are 0600.
_DETACH = 'umask 077; log=$1; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!'


def _start(d: Path) -> Record:
    values = _secrets(d)
    prefect = Path(sys.executable).parent / "prefect"
    for _ in range(START_ATTEMPTS):
        port = _free_port()
        cmd = [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        out = subprocess.run(
            ["sh", "-c", _DETACH, "sh", str(d / LOG), *cmd],
            env=_server_env(d, port, values),
            capture_output=True,
            text=True,
            check=True,
            start_new_session=True,
        )
        pid = int(out.stdout.strip())
        proc = psutil.Process(pid)
        record = Record(pid=pid, pgid=os.getpgid(pid), port=port, started_at=proc.create_time())
        # Recorded before it answers: a command killed while it waits leaves a record the next one checks
        # (and reuses or stops), not a server nobody knows of.
        _write_record(d, record)
        if _wait_healthy(record, values[AUTH_VAR]):
            return record
        _stop_group(record)
        (d / RECORD).unlink(missing_ok=True)
    raise LocalServerError(
        f"the local Prefect server did not come up in {START_TIMEOUT_S:.0f} s ({START_ATTEMPTS} tries); "
        f"see {d / LOG}, or set {MODE_VAR}=temporary to use a temporary server"
    )


def _wait_healthy(record: Record, auth: str) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _is_our_process(record):  # exited: its port was taken, or it failed (its log says why)
            return False
        if _answers(record, auth, timeout=2.0):
            return True
        time.sleep(0.2)
    return False


def _stop_group(record: Record) -> None:
    """SIGTERM the server's processes, SIGKILL what is left after the grace."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        procs = alive_in_group(record.pgid)
        for p in procs:
            _signal(p, sig)
        # Liveness by process state: a killed server may stay a zombie a while before it is reaped.
        deadline = time.monotonic() + grace
        while procs and time.monotonic() < deadline:
            time.sleep(0.1)
            procs = alive_in_group(record.pgid)
        if not procs:
            return


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass  # gone on its own
