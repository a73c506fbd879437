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
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import entry_points, version
from pathlib import Path

import psutil

from flows.server_mode import MODE_VAR, LocalServerError, Mode, mode, server_dir
from traingate.settings import PREFECT_DB_CACHE_VAR, environment

RECORD = "server.json"
SECRETS = "secrets.env"
LOG = "server.log"
LOCK = "lock"
AUTH_VAR = "PREFECT_SERVER_API_AUTH_STRING"
CLIENT_AUTH_VAR = "PREFECT_API_AUTH_STRING"
KEY_VAR = "PREFECT_SERVER_ENCRYPTION_KEY"
CACHE_VAR = PREFECT_DB_CACHE_VAR
CACHE_DIR = "prefect-db-cache"
# What a server started on a copy of a cached database skips: the copy is at this Prefect's last migration
# and holds the block types it registers.
SEEDED_SERVER_ENV = {
    "PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false",
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
}
# A loaded 2-core machine takes 5-20 s to bring a Prefect server up; 180 s leaves room for a much busier one.
START_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
ANSWER_PATIENCE_S = 60.0  # how long a running server may fail its health check before it counts as hung
START_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it


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


def connect(state_dir: Path) -> Record | None:
    """Point this process's Prefect client at the kept server (started now if none is running) and return
    its record; None where the setting or ``PREFECT_API_URL`` says another server is used.

    Call it before anything makes a Prefect client: Prefect reads its settings from the environment at import,
    and again here when it is imported already.
    """
    if os.environ.get("PREFECT_API_URL") or mode() is Mode.TEMPORARY:
        return None
    record, started = ensure(state_dir)
    os.environ["PREFECT_API_URL"] = record.api_url
    os.environ[CLIENT_AUTH_VAR] = _secrets(server_dir(state_dir))[AUTH_VAR]
    os.environ.pop(AUTH_VAR, None)  # a temporary server's (authenticate_temporary): no server of this process
    os.environ.pop("PREFECT_API_KEY", None)  # it wins over the auth string and breaks it
    if "prefect" in sys.modules:
        # A command forked from the CLI engine (flows.cli_engine), which imported Prefect under its own environment
        # and made no client: Prefect's settings are read again from this one (35 ms) and its logging configured
        # again (50 ms: every setting is templated), each unless what it is made from is what the engine's was.
        _read_prefect_settings_again()
    if started:
        print(
            f"traingate: started a local Prefect server at {record.ui_url} (pid {record.pid}), kept for later "
            "commands; `traingate server stop` stops it",
            file=sys.stderr,
            flush=True,
        )
    return record


def _read_prefect_settings_again() -> None:
    if _SETTINGS_READ_FROM is None or _prefect_settings_inputs() != _SETTINGS_READ_FROM:
        sys.modules["prefect.context"].refresh_global_settings_context()
    if _LOGGING_SET_UP_FROM is None or _prefect_logging_inputs() != _LOGGING_SET_UP_FROM:
        sys.modules["prefect.logging.configuration"].setup_logging(incremental=False)


_SETTINGS_READ_FROM: tuple[object, ...] | None = None
_LOGGING_SET_UP_FROM: tuple[object, ...] | None = None


def _prefect_settings_inputs() -> tuple[object, ...]:
    """What Prefect's settings are read from in this process: the ``PREFECT_*`` variables, its profiles file, and
    in the working directory what of ``.env`` (its ``PREFECT_*`` lines), ``prefect.toml`` and ``pyproject.toml``
    (its ``[tool.prefect]`` table) could set one."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.upper().startswith("PREFECT_")))
    profiles = Path(sys.modules["prefect.context"].get_settings_context().settings.profiles_path)
    return env, profiles, _stamp(profiles), _dotenv_prefect_lines(), _stamp(Path("prefect.toml")), _tool_prefect()


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _dotenv_prefect_lines() -> tuple[str, ...]:
    try:
        lines = Path(".env").read_text(errors="replace").splitlines()
    except OSError:
        return ()
    return tuple(line.strip() for line in lines if "PREFECT_" in line.upper())


def _tool_prefect() -> object:
    try:
        return tomllib.loads(Path("pyproject.toml").read_text()).get("tool", {}).get("prefect")
    except (OSError, ValueError):
        return _stamp(Path("pyproject.toml"))  # unreadable or not TOML here: read again when it changes


def _prefect_logging_inputs() -> tuple[object, ...]:
    """What Prefect's logging configuration is made from in this process: its logging settings (the configuration
    file's path among them), the two levels its default file names besides, the ``PREFECT_LOGGING_*``
    overrides, and the configuration file's modification time."""
    settings = sys.modules["prefect.context"].get_settings_context().settings
    path = Path(settings.logging.config_path or "")
    try:
        stamp = path.stat().st_mtime_ns if path.is_file() else None
    except OSError:
        stamp = None
    overrides = sorted((k, v) for k, v in os.environ.items() if k.startswith("PREFECT_LOGGING_"))
    levels = settings.internal.logging_level, settings.server.logging_level
    return settings.logging.model_dump_json(), levels, tuple(overrides), stamp


def note_prefect_setup() -> None:
    """As the CLI engine preloads it, Prefect imported: what Prefect's settings were read from and its logging
    configured from as it was imported, so a forked command whose own inputs are the same keeps them
    (:func:`connect`)."""
    global _SETTINGS_READ_FROM, _LOGGING_SET_UP_FROM
    _SETTINGS_READ_FROM = _prefect_settings_inputs()
    _LOGGING_SET_UP_FROM = _prefect_logging_inputs()


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


# ---------------------------------------------------------------- the database cache

# The tables a Prefect server fills as it starts on an empty database (its migrations' version, the block types
# it registers): a database with rows in any other table holds records and is never cached.
STARTUP_TABLES = frozenset({"alembic_version", "block_type", "block_schema", "block_schema_reference"})


def db_cache_dir(state_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    """Where migrated, empty Prefect databases are cached: ``TRAINGATE_PREFECT_DB_CACHE``, else
    ``<state dir>/prefect-db-cache``.

    >>> db_cache_dir(Path("/s"), {}), db_cache_dir(Path("/s"), {CACHE_VAR: "/ci-cache"})
    (PosixPath('/s/prefect-db-cache'), PosixPath('/ci-cache'))
    """
    env = os.environ if env is None else env
    return Path(env[CACHE_VAR]) if env.get(CACHE_VAR) else state_dir / CACHE_DIR


def db_cache_key() -> str:
    """The cached database's name for this installation: the Prefect version (its last migration) and the
    Prefect collections installed (a server registers their block types too). Another version, or another
    set of collections, names another file: a database cached for one is never used by the other.

    >>> db_cache_key().startswith(f"prefect-{version('prefect')}-")
    True
    """
    collections = sorted(
        f"{ep.dist.name}=={ep.dist.version}" if ep.dist is not None else ep.value
        for ep in entry_points(group="prefect.collections")
    )
    digest = hashlib.sha256("\n".join(collections).encode()).hexdigest()[:12]
    return f"prefect-{version('prefect')}-{digest}.db"


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite database URL as Prefect's settings hold it; None for any other database.

    >>> sqlite_file("sqlite+aiosqlite:////tmp/x/prefect.db"), sqlite_file("postgresql+asyncpg://db/prefect")
    (PosixPath('/tmp/x/prefect.db'), None)
    """
    for prefix in ("sqlite+aiosqlite:///", "sqlite:///"):
        if url.startswith(prefix):
            path = url.removeprefix(prefix).split("?", 1)[0]
            return Path(path) if path and path != ":memory:" else None
    return None


@dataclass(frozen=True)
class Seeding:
    """What :func:`seed_database` did for one server start on ``db``."""

    db: Path
    cached: Path
    env: dict[str, str]  # settings to add to the server's environment: SEEDED_SERVER_ENV when ``db`` is a copy
    created: bool  # no file was at ``db``: the server makes (or was given) a new database

    def started(self) -> None:
        """The server answers and no client has written to it yet: a database it migrated itself is cached
        (a snapshot) for the next server."""
        if self.created and not self.env and not self.cached.exists():
            _keep(self.db, self.cached)


def seed_database(db: Path, cache: Path, key: str | None = None) -> Seeding:
    """Before a Prefect server starts on the SQLite file ``db``:

    - ``db`` exists: the server's own database, used as it is.
    - No ``db``, and a database cached under ``key`` (default :func:`db_cache_key`) in ``cache``: ``db`` is a
      copy of it and the server skips its migrations and block registration (:data:`SEEDED_SERVER_ENV`),
      about 9 of the 13 CPU-s of a start on an empty file.
    - No ``db`` and none cached: the server migrates its own, and :meth:`Seeding.started` caches a snapshot
      of it for the next server.

    The copy is linked into place only where no file is: a database another command created meanwhile is
    used as it is. The cache is written under a temporary name and renamed, so a reader finds a whole
    database or none.
    """
    cached = cache / (key or db_cache_key())
    if db.exists():
        return Seeding(db, cached, {}, created=False)
    db.parent.mkdir(parents=True, exist_ok=True)
    seeded = cached.exists() and _seed(db, cached)
    return Seeding(db, cached, dict(SEEDED_SERVER_ENV) if seeded else {}, created=True)


@contextmanager
def temporary_server_start(db_url: str, state_dir: Path) -> Iterator[None]:
    """Around the start of Prefect's temporary server for this process, whose database is ``db_url`` (Prefect's
    setting): a new SQLite file is seeded from the cache (:func:`seed_database`). Prefect starts that server
    with this process's environment, so the settings that go with a copy are in it for the block only.
    """
    db = sqlite_file(db_url)
    if db is None:  # another database (PostgreSQL): its server's own
        yield
        return
    seeding = seed_database(db, db_cache_dir(state_dir))
    with environment(seeding.env):
        yield
    seeding.started()


def _seed(db: Path, cached: Path) -> bool:
    """Copy ``cached`` to ``db`` unless a file appeared there meanwhile; whether it did."""
    tmp = db.with_name(f".{db.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out, cached.open("rb") as src:
        shutil.copyfileobj(src, out)
    try:
        os.link(tmp, db)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def _keep(db: Path, cached: Path) -> None:
    """Cache a snapshot of the server's database ``db`` as ``cached`` if the snapshot holds nothing but what a
    start writes (SQLite's backup: a consistent copy while the server has the file open; checked on the copy,
    so a write that lands meanwhile is either in it, and it is dropped, or not in it at all)."""
    cached.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    try:
        with contextlib.closing(sqlite3.connect(db)) as src, contextlib.closing(sqlite3.connect(tmp)) as copy:
            src.backup(copy)
            tables = {row[0] for row in copy.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if any(copy.execute(f'SELECT 1 FROM "{t}" LIMIT 1').fetchone() for t in tables - STARTUP_TABLES):
                return
            # One self-contained file (no write-ahead log beside it) that a byte copy reproduces; Prefect turns
            # the log on again when it opens the copy.
            copy.execute("PRAGMA journal_mode = DELETE")
        os.replace(tmp, cached)
    except sqlite3.OperationalError:
        pass  # the server held a write lock past SQLite's 5 s wait: a later start on a new file caches
    finally:
        tmp.unlink(missing_ok=True)


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


def detached(cmd: list[str], log: Path, env: Mapping[str, str], cwd: Path | None = None) -> int:
    """Start ``cmd`` in a session of its own with no parent among traingate's processes, its output appended to
    ``log``; its pid."""
    out = subprocess.run(
        ["sh", "-c", _DETACH, "sh", str(log), *cmd],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
    )
    return int(out.stdout.strip())


def _start(d: Path) -> Record:
    values = _secrets(d)
    prefect = Path(sys.executable).parent / "prefect"
    for _ in range(START_ATTEMPTS):
        port = _free_port()
        cmd = [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        seeding = seed_database(d / "prefect.db", db_cache_dir(d.parent))
        pid = detached(cmd, d / LOG, {**_server_env(d, port, values), **seeding.env})
        proc = psutil.Process(pid)
        record = Record(pid=pid, pgid=os.getpgid(pid), port=port, started_at=proc.create_time())
        # Recorded before it answers: a command killed while it waits leaves a record the next one checks
        # (and reuses or stops), not a server nobody knows of.
        _write_record(d, record)
        if _wait_healthy(record, values[AUTH_VAR]):
            seeding.started()
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
