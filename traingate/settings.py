"""Where things live. Every location is a URI derived from one settings object.

Settings come from environment variables with the ``TRAINGATE_`` prefix; nothing
else in the project hard-codes a path. The embedded defaults put everything under
one state directory (``./.traingate`` unless ``TRAINGATE_STATE_DIR`` says otherwise).

That default is for a laptop. A flow run on a work pool takes its locations from the pool
(``traingate pools bootstrap`` writes :func:`pool_locations` into the pool's job template) and
refuses to fall back to the directory its code was pulled into (:func:`for_deployment`);
read-only commands say which store they read and never create an empty one (:func:`store_to_read`).

>>> s = Settings.from_env({"TRAINGATE_STATE_DIR": "/tmp/tg"})
>>> s.tracking_uri
'sqlite:////tmp/tg/mlflow.db'
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from traingate.commandenv import CLI_ENGINE_VAR as CLI_ENGINE_VAR
from traingate.commandenv import PREFECT_SERVER_VAR as PREFECT_SERVER_VAR
from traingate.commandenv import STATE_DIR_VAR as STATE_DIR_VAR
from traingate.commandenv import state_dir
from traingate.redact import redact

if TYPE_CHECKING:
    from collections.abc import MutableMapping
    from typing import TextIO


TRACKING_URI_VAR = "TRAINGATE_TRACKING_URI"
ARTIFACT_URI_VAR = "TRAINGATE_ARTIFACT_URI"
CHECKPOINT_URI_VAR = "TRAINGATE_CHECKPOINT_URI"
OPTUNA_STORAGE_VAR = "TRAINGATE_OPTUNA_STORAGE"
# Where migrated, empty Prefect databases are cached (flows.local_server.db_cache_dir); unset: under the state dir.
PREFECT_DB_CACHE_VAR = "TRAINGATE_PREFECT_DB_CACHE"
S3_ENDPOINT_VAR = "TRAINGATE_S3_ENDPOINT_URL"
# The socket of the engine flow runs are forked from (a process worker's flow-run zygote, flows/warm_engine.py; a
# command's of the kept server's CLI engine, flows/cli_engine.py), which forks a built-in recipe's unit tests too;
# unset: they start cold.
ENGINE_SOCKET_VAR = "TRAINGATE_ENGINE_SOCKET"
# Where a deployment's pull step puts the code (deployments/prefect.yaml: set_working_directory).
CODE_DIR_VAR = "TRAINGATE_CODE_DIR"
# Every location a user or a pool sets; a pool's job template carries the ones that are set.
LOCATION_VARS = (
    STATE_DIR_VAR,
    TRACKING_URI_VAR,
    ARTIFACT_URI_VAR,
    CHECKPOINT_URI_VAR,
    OPTUNA_STORAGE_VAR,
    S3_ENDPOINT_VAR,
)
# A tracking server's own artifact store (its --artifacts-destination), reached through the server.
SERVER_ARTIFACTS = "mlflow-artifacts:/"
IMAGE_VAR = "TRAINGATE_IMAGE"  # the pinned training image of container pools (`traingate pools bootstrap`)
NODES_VAR = "TRAINGATE_NODES"  # where a multi-node job's node agents run ("netns:NS0,NS1"; traingate.launch.nodes)
# Container pools (`traingate pools bootstrap`): the networks and volumes of every flow-run container
# (comma-separated), and which credential variables a flow run reads from which Prefect Secret block
# ("VAR=block-name,..."; names only: a container does not inherit its worker's environment).
DOCKER_NETWORKS_VAR = "TRAINGATE_DOCKER_NETWORKS"
DOCKER_VOLUMES_VAR = "TRAINGATE_DOCKER_VOLUMES"
SECRET_BLOCKS_VAR = "TRAINGATE_SECRET_BLOCKS"
# Which environment variables a spec's ${env:NAME} may read (comma-separated names; a trailing * matches
# a prefix). A spec is written by whoever may start a run; the worker's environment holds the stack's
# credentials, so only the names listed here resolve (traingate.secrets.resolve).
ENV_ALLOW_VAR = "TRAINGATE_ENV_ALLOW"
# Hosts (or bucket names) a URL holding a resolved reference may reach, besides loopback and the hosts of
# the tracking URI and the S3 endpoint: a reference resolved into any other URL would carry the value away.
ENV_HOSTS_VAR = "TRAINGATE_ENV_HOSTS"
# The per-deployment key that signs checkpoint manifests; unset, one is generated once into the state dir.
CHECKPOINT_KEY_VAR = "TRAINGATE_CHECKPOINT_KEY"
CHECKPOINT_KEY_FILE = "checkpoint.key"
# Names a spec may always reference: where `traingate run` moves the spec's own literal secrets.
ALWAYS_ALLOWED = ("TRAINGATE_SECRET_*",)


@dataclass(frozen=True)
class Settings:
    state_dir: Path
    tracking_uri: str
    artifact_uri: str
    checkpoint_uri: str
    optuna_storage: str
    s3_endpoint_url: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        state = state_dir(env)
        tracking = env.get(TRACKING_URI_VAR) or f"sqlite:///{state}/mlflow.db"
        # Beside a tracking server, the default is the server's artifact store: a file:// location on
        # this machine's disk would be one the server cannot serve and the next container loses.
        artifacts = (
            SERVER_ARTIFACTS if tracking.startswith(("http://", "https://")) else (state / "mlartifacts").as_uri()
        )
        return cls(
            state_dir=state,
            tracking_uri=tracking,
            artifact_uri=env.get(ARTIFACT_URI_VAR) or artifacts,
            checkpoint_uri=env.get(CHECKPOINT_URI_VAR) or (state / "checkpoints").as_uri(),
            optuna_storage=env.get(OPTUNA_STORAGE_VAR) or f"sqlite:///{state}/optuna.db",
            s3_endpoint_url=env.get(S3_ENDPOINT_VAR) or None,
        )

    def ensure(self) -> Settings:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        return self


class LocationError(ValueError):
    """A location that is unset or points where state must not go. One line: the variable, the value, the fix."""


def secret_blocks(text: str | None) -> dict[str, str]:
    """``TRAINGATE_SECRET_BLOCKS``: which environment variable comes from which Prefect Secret block.

    >>> secret_blocks("AWS_SECRET_ACCESS_KEY=tg-aws-secret, PGPASSWORD=tg-pg")
    {'AWS_SECRET_ACCESS_KEY': 'tg-aws-secret', 'PGPASSWORD': 'tg-pg'}
    >>> secret_blocks("PGPASSWORD")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    traingate.settings.LocationError: TRAINGATE_SECRET_BLOCKS = 'PGPASSWORD': entry 'PGPASSWORD' is not
    VAR=block-name; write e.g. PGPASSWORD=traingate-pgpassword
    """
    out: dict[str, str] = {}
    for entry in (e.strip() for e in (text or "").split(",")):
        if not entry:
            continue
        var, _, block = (x.strip() for x in entry.partition("="))
        if not (
            var
            and block
            and var.replace("_", "").isalnum()
            and var[0].isalpha()
            and all(ch.islower() or ch.isdigit() or ch == "-" for ch in block)
        ):
            raise LocationError(
                f"{SECRET_BLOCKS_VAR} = {text!r}: entry {entry!r} is not VAR=block-name; write e.g. "
                "PGPASSWORD=traingate-pgpassword"
            )
        out[var] = block
    return out


def code_dir() -> Path:
    """The directory this code was installed or pulled into (it holds ``traingate/``, ``flows/``, ``tasks/``)."""
    return Path(__file__).resolve().parents[1]


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def pool_locations(pool: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The locations every flow run on ``pool`` gets, as its job template's environment.

    Taken from ``env`` (the bootstrap's environment, like the production stack's shared settings):
    the state directory is required and absolute; the other locations are passed on when set.

    >>> pool_locations("cpu-local", {"TRAINGATE_STATE_DIR": "/srv/traingate"})
    {'TRAINGATE_STATE_DIR': '/srv/traingate'}
    >>> pool_locations("cpu-local", {})  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    traingate.settings.LocationError: pool cpu-local: TRAINGATE_STATE_DIR is not set: flow runs on the pool would
    write their state into the directory their code was pulled into; set TRAINGATE_STATE_DIR to an absolute path on
    the pool's nodes (and the TRAINGATE_*_URI locations of shared stores) where you run the bootstrap
    """
    env = os.environ if env is None else env
    state = env.get(STATE_DIR_VAR, "")
    if not state:
        raise LocationError(
            f"pool {pool}: {STATE_DIR_VAR} is not set: flow runs on the pool would write their state "
            f"into the directory their code was pulled into; set {STATE_DIR_VAR} to an absolute path "
            "on the pool's nodes (and the TRAINGATE_*_URI locations of shared stores) where you run "
            "the bootstrap"
        )
    if not Path(state).is_absolute() or "{{" in state:
        raise LocationError(
            f"pool {pool}: {STATE_DIR_VAR} = {state!r} is not an absolute path; every flow run would "
            "resolve it against its own working directory; give an absolute path on the pool's nodes"
        )
    out = {var: env[var] for var in LOCATION_VARS if env.get(var)}
    for var in (ENV_ALLOW_VAR, ENV_HOSTS_VAR):  # names and hosts, not values: what a pool's specs may reference
        if env.get(var):
            out[var] = env[var]
    if env.get(SECRET_BLOCKS_VAR):  # block names, not secrets: where a container's flow run finds its credentials
        secret_blocks(env[SECRET_BLOCKS_VAR])
        out[SECRET_BLOCKS_VAR] = env[SECRET_BLOCKS_VAR]
    if out.get(S3_ENDPOINT_VAR):  # MLflow's S3 client reads its own variable (a MinIO or other non-AWS endpoint)
        out.setdefault("MLFLOW_S3_ENDPOINT_URL", env.get("MLFLOW_S3_ENDPOINT_URL") or out[S3_ENDPOINT_VAR])
    return out


def for_deployment(env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Settings:
    """The settings of a flow run a worker started: refused when they would put state in the code directory.

    A pool's job template sets the locations (:func:`pool_locations`). Without them the embedded default
    is ``./.traingate`` in the directory the deployment's pull step chose: the code checkout (every later
    run's code version then reads as dirty) or the image's code directory (lost with the container).
    """
    env = os.environ if env is None else env
    cwd = (cwd or Path.cwd()).resolve()
    if not env.get(STATE_DIR_VAR):
        raise LocationError(
            f"{STATE_DIR_VAR} is not set for this flow run: its state would go to "
            f"{cwd / '.traingate'}, inside the code directory; set the pool's locations with "
            "`traingate pools bootstrap` (TRAINGATE_STATE_DIR in its environment) or in the worker's "
            "environment"
        )
    settings = Settings.from_env(env)
    for root in {code_dir(), cwd}:
        if _inside(settings.state_dir, root) and (root / "flows").is_dir():
            raise LocationError(
                f"{STATE_DIR_VAR} = {env[STATE_DIR_VAR]!r} resolves to {settings.state_dir}, inside "
                f"the code directory {root}; give the pool a state directory outside the code"
            )
    return settings


def store_to_read(command: str, env: Mapping[str, str] | None = None, *, out: TextIO | None = None) -> Settings:
    """The settings a read-only command uses, after saying on ``out`` (stderr) which tracking store it reads.

    A SQLite store that does not exist is refused (MLflow would create an empty one and the command
    would show nothing, as if the runs were gone); so is an empty ``file:`` store.
    """

    env = os.environ if env is None else env
    settings = Settings.from_env(env)
    where = (
        f"{TRACKING_URI_VAR}"
        if env.get(TRACKING_URI_VAR)
        else f"{STATE_DIR_VAR}={env[STATE_DIR_VAR]}"
        if env.get(STATE_DIR_VAR)
        else f"{STATE_DIR_VAR} unset: ./.traingate in {Path.cwd()}"
    )
    print(f"traingate {command}: reading {redact(settings.tracking_uri)} ({where})", file=out or sys.stderr)
    uri = settings.tracking_uri
    path = (
        Path(uri[len("sqlite:///") :])
        if uri.startswith("sqlite:///")
        else Path(uri[len("file://") :])
        if uri.startswith("file://")
        else None
    )
    if path is not None and not (path.is_file() or (path.is_dir() and any(path.iterdir()))):
        raise LocationError(
            f"no tracking store at {path}: {command} reads the store your runs wrote; set "
            f"{STATE_DIR_VAR} to their state directory (a pool's is in its job template: "
            f"prefect work-pool inspect POOL) or {TRACKING_URI_VAR} to their tracking server"
        )
    return settings


def export_s3_endpoint(env: MutableMapping[str, str] | None = None) -> None:
    """Point MLflow's S3 client at ``TRAINGATE_S3_ENDPOINT_URL`` (MinIO, or any non-AWS S3).

    MLflow reads only ``MLFLOW_S3_ENDPOINT_URL``; without it an ``s3://`` artifact location would be
    written to AWS, not to the configured store. An explicit ``MLFLOW_S3_ENDPOINT_URL`` wins.
    Child processes (training ranks) inherit it.
    """
    env = os.environ if env is None else env
    endpoint = env.get(S3_ENDPOINT_VAR)
    if endpoint and not env.get("MLFLOW_S3_ENDPOINT_URL"):
        env["MLFLOW_S3_ENDPOINT_URL"] = endpoint


def _names(text: str | None) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def env_allowed(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether a spec's ``${env:NAME}`` may read ``name`` (``TRAINGATE_ENV_ALLOW``).

    >>> env_allowed("WANDB_API_KEY", {"TRAINGATE_ENV_ALLOW": "HF_TOKEN, WANDB_*"})
    True
    >>> env_allowed("AWS_SECRET_ACCESS_KEY", {"TRAINGATE_ENV_ALLOW": "HF_TOKEN, WANDB_*"})
    False
    >>> env_allowed("TRAINGATE_SECRET_3", {})
    True
    """
    env = os.environ if env is None else env
    for pattern in (*ALWAYS_ALLOWED, *_names(env.get(ENV_ALLOW_VAR))):
        if pattern == name or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            return True
    return False


_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def host_allowed(host: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether a URL holding a resolved ``${env:NAME}`` may go to ``host`` (a hostname or a bucket).

    Loopback, the hosts of the configured tracking URI and S3 endpoint, and ``TRAINGATE_ENV_HOSTS``.

    >>> host_allowed("hooks.slack.com", {"TRAINGATE_ENV_HOSTS": "hooks.slack.com"})
    True
    >>> host_allowed("attacker.example", {"TRAINGATE_TRACKING_URI": "http://mlflow:5000"})
    False
    """
    env = os.environ if env is None else env
    host = host.lower().strip("[]")
    if host in _LOOPBACK or host.startswith("127."):
        return True
    configured = [urlsplit(env.get(v) or "").hostname for v in (TRACKING_URI_VAR, S3_ENDPOINT_VAR)]
    return host in {h.lower() for h in configured if h} | {h.lower() for h in _names(env.get(ENV_HOSTS_VAR))}


def checkpoint_key(settings: Settings, env: Mapping[str, str] | None = None) -> bytes:
    """The key that signs this deployment's checkpoint manifests.

    ``TRAINGATE_CHECKPOINT_KEY`` when set (every host of a multi-host deployment needs the same one);
    otherwise ``checkpoint.key`` in the state directory, generated once (32 random bytes, mode 0600).
    """
    env = os.environ if env is None else env
    if env.get(CHECKPOINT_KEY_VAR):
        if len(env[CHECKPOINT_KEY_VAR]) < 32:
            raise LocationError(
                f"{CHECKPOINT_KEY_VAR} holds {len(env[CHECKPOINT_KEY_VAR])} characters: too short to sign "
                "checkpoints; set at least 32 random characters (e.g. `openssl rand -hex 32`)"
            )
        return env[CHECKPOINT_KEY_VAR].encode()
    path = settings.ensure().state_dir / CHECKPOINT_KEY_FILE
    if not path.exists():
        # Written whole under a temporary name of its own (threads of one process, sweep trials, race too),
        # then linked into place: of two first runs at once, one link wins and both read the same key; no
        # reader ever sees a half-written file.
        fd, name = tempfile.mkstemp(prefix=f".{CHECKPOINT_KEY_FILE}.", dir=path.parent)  # mode 0600
        tmp = Path(name)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    key = path.read_bytes().strip()
    if len(key) < 32:
        raise LocationError(
            f"{path}: a checkpoint key of {len(key)} bytes (needs at least 32); remove the file to "
            f"generate a new one (checkpoints signed with it are then refused) or set {CHECKPOINT_KEY_VAR}"
        )
    return key


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the block; after it each of those variables is what it was
    before (unset if it was unset). Other variables are left as the block leaves them.

    >>> with environment({"TG_DOCTEST_VAR": "1"}):
    ...     os.environ["TG_DOCTEST_VAR"]
    '1'
    >>> "TG_DOCTEST_VAR" in os.environ
    False
    """
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
