"""The production stack of infra/docker-compose.yml, natively on loopback (no Docker).

    python infra/local_stack.py up|down|status|env [--dir DIR] [--port SERVICE=PORT ...]

The compose file is the source: every service's ``command``, ``entrypoint``, ``environment``
(``env_file`` included), ``depends_on`` conditions, ``healthcheck``, ``stop_signal`` and
``stop_grace_period`` are read from it and run here as processes, with

- service host names (``postgres:5432``, ``mlflow:5000``, ...) mapped to ``127.0.0.1:<port>``
  (a free loopback port per service with an ``expose``d port, or ``--port SERVICE=PORT``), and a
  service's own ``localhost``/``0.0.0.0`` and ``--port`` to its loopback port;
- volume paths mapped into the state dir (``<dir>/volumes/<name>``), bind mounts to the files beside
  the compose file, the training image's WORKDIR (infra/Dockerfile) to this checkout;
- native equivalents for the images with no native command: ``postgres`` (initdb/pg_ctl of the
  Debian PostgreSQL 15, the init scripts of /docker-entrypoint-initdb.d) and ``minio/minio`` (moto's
  S3 server with its IAM checks on and its control routes refused, infra/moto_s3_server.py; it keeps
  objects in memory, so ``down`` saves the buckets into the s3 volume and ``up`` puts them back);
  ``minio/mc`` runs its compose command with a small ``mc`` of ours on the PATH.
  Their healthchecks still come from the compose file.
- services that mount the Docker socket (the container pools' workers) are not started when there
  is no Docker engine; ``status`` says so.

Non-secret settings come from infra/stack.env (the compose file's ``env_file`` and
``--env-file``); secrets (``SECRET_VARS``: the superuser's and each service's database password, the
S3 root key and each service's S3 key, Prefect's API auth string and Secret encryption key, MLflow's
admin and platform passwords and session key) from the environment, else generated once into
``<dir>/secrets.env`` (mode 0600). ``up`` and ``status`` never print them; ``env`` prints what a
client needs, its credentials included (``eval "$(infra/local-stack.sh env)"``).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

INFRA = Path(__file__).resolve().parent
ROOT = INFRA.parent
COMPOSE = INFRA / "docker-compose.yml"
SETTINGS = INFRA / "stack.env"
DOCKERFILE = INFRA / "Dockerfile"
SECRET_VARS = (
    "POSTGRES_PASSWORD", "PREFECT_DB_PASSWORD", "MLFLOW_DB_PASSWORD", "OPTUNA_DB_PASSWORD",
    "S3_ACCESS_KEY", "S3_SECRET_KEY", "S3_MLFLOW_ACCESS_KEY", "S3_MLFLOW_SECRET_KEY",
    "S3_WORKER_ACCESS_KEY", "S3_WORKER_SECRET_KEY",
    "PREFECT_AUTH_STRING", "PREFECT_ENCRYPTION_KEY",
    "MLFLOW_ADMIN_PASSWORD", "MLFLOW_PLATFORM_PASSWORD", "MLFLOW_SECRET_KEY",
)
# What a client of the stack sets to reach it as the platform (the workers' own credentials).
CLIENT_CREDENTIALS = ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                      "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "PGPASSWORD")
# moto checks a request's signature in its Authorization header only: it cannot check a presigned URL (the
# signature in the query string), so the native S3 server refuses those. MLflow hands its clients presigned
# URLs of an S3 artifact store for downloads and large uploads; these make them go through the server.
NATIVE_S3_CLIENT_ENV = {"MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD": "false", "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD": "false"}
PG_BIN = Path(os.environ.get("TRAINGATE_PG_BIN", "/usr/lib/postgresql/15/bin"))
DOCKER_SOCKET = "/var/run/docker.sock"
BIN = Path(sys.executable).parent
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"  # util-linux; often off a plain user's PATH


class StackError(Exception):
    """A one-line reason the stack cannot come up (exit 2)."""


def new_secret(var: str) -> str:
    """A fresh value for one of ``SECRET_VARS``, in the form its consumer needs."""
    if var == "PREFECT_ENCRYPTION_KEY":  # a Fernet key: 32 random bytes, url-safe base64
        return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
    if var == "PREFECT_AUTH_STRING":  # HTTP basic credentials, user:password
        return f"traingate:{secrets.token_hex(16)}"
    return secrets.token_hex(16)


# ---------------------------------------------------------------- compose: parse and interpolate

def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise StackError(f"{path}:{n}: {line!r} is not NAME=value")
        k, v = line.split("=", 1)
        out[k.strip()] = v.strip().strip('"').strip("'")
    return out


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$`` (a literal ``$``).

    >>> interpolate("a ${X} ${Y:-d} $$Z", {"X": "1"})
    'a 1 d $Z'
    """
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        val = env.get(name)
        unset_or_empty = val is None or (val == "" and op and op.startswith(":"))
        if op in (":-", "-") and unset_or_empty:
            return arg
        if op in (":?", "?") and unset_or_empty:
            raise StackError(f"${{{name}}}: {arg or 'required'}")
        return val or ""
    return _VAR.sub(one, text)


def _interpolate_tree(obj: Any, env: dict[str, str]) -> Any:
    if isinstance(obj, str):
        return interpolate(obj, env)
    if isinstance(obj, list):
        return [_interpolate_tree(x, env) for x in obj]
    if isinstance(obj, dict):
        return {k: _interpolate_tree(v, env) for k, v in obj.items()}
    return obj


def load_compose(env: dict[str, str], path: Path = COMPOSE) -> dict[str, Any]:
    """The compose file, YAML anchors and merge keys resolved, ``${VAR}`` interpolated from ``env``."""
    return _interpolate_tree(yaml.safe_load(path.read_text()), env)


def service_environment(svc: dict[str, Any], compose_dir: Path = INFRA) -> dict[str, str]:
    """A service's environment as compose gives it: its env_file(s), then ``environment`` over them."""
    out: dict[str, str] = {}
    files = svc.get("env_file") or []
    for f in [files] if isinstance(files, str) else files:
        out.update(read_env_file(compose_dir / (f if isinstance(f, str) else f["path"])))
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, os.environ.get(e, "")) for e in env)
    out.update({k: "" if v is None else str(v) for k, v in env.items()})
    return out


def _argv(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(x) for x in value]


def _duration_s(value: Any, default: float) -> float:
    """Compose durations: ``5s``, ``1m30s``, ``500ms``."""
    if value is None:
        return default
    total = 0.0
    for num, unit in re.findall(r"([\d.]+)(ms|us|h|m|s)", str(value)):
        total += float(num) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


def image_repo(image: str) -> str:
    """``minio/minio:RELEASE...`` -> ``minio/minio``; ``postgres:15`` -> ``postgres``."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def one_shot_services(compose: dict[str, Any]) -> set[str]:
    """Services something waits on to complete (``service_completed_successfully``): run to the end."""
    out = set()
    for svc in compose["services"].values():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, dict):
            out |= {d for d, c in deps.items() if (c or {}).get("condition") == "service_completed_successfully"}
    return out


def start_order(compose: dict[str, Any]) -> list[str]:
    services = compose["services"]
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in path:
            raise StackError(f"depends_on cycle: {' -> '.join(path + (name,))}")
        if name not in services:
            raise StackError(f"services.{path[-1]}.depends_on names {name!r}, which is not a service")
        for dep in services[name].get("depends_on") or []:
            visit(dep, path + (name,))
        order.append(name)

    for name in services:
        visit(name, ())
    return order


def _image_workdir() -> str | None:
    """The training image's code directory (infra/Dockerfile's WORKDIR): this checkout, natively."""
    for line in DOCKERFILE.read_text().splitlines():
        if line.strip().upper().startswith("WORKDIR "):
            return line.split(None, 1)[1].strip()
    return None


# ---------------------------------------------------------------- the native plan

@dataclass
class Plan:
    """How one compose service runs here."""
    name: str
    kind: str  # "command" | "postgres" | "s3" | "skipped"
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    one_shot: bool
    healthcheck: list[str] | None
    health_env: dict[str, str]
    interval_s: float
    timeout_s: float
    deadline_s: float
    stop_signal: int
    grace_s: float
    port: int | None
    container_port: int | None
    reason: str = ""
    depends_on: dict[str, str] = field(default_factory=dict)


NATIVE_IMAGES = {  # images whose command cannot run here -> the native equivalent
    "postgres": "postgres",
    "minio/minio": "s3",
}


class Stack:
    def __init__(self, state_dir: Path, ports: dict[str, int] | None = None, env: dict[str, str] | None = None):
        self.dir = state_dir.resolve()
        self.env_in = dict(os.environ if env is None else env)
        self.state_file = self.dir / "stack.json"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {"ports": {}, "procs": {}}
        self.requested_ports = ports or {}

    # ---- settings and secrets
    def secrets(self, create: bool) -> dict[str, str]:
        path = self.dir / "secrets.env"
        stored = read_env_file(path) if path.exists() else {}
        out = {}
        for var in SECRET_VARS:
            out[var] = self.env_in.get(var) or stored.get(var) or ""
        missing = [v for v in SECRET_VARS if not out[v]]
        if missing and create:
            for v in missing:
                out[v] = new_secret(v)
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("".join(f"{v}={out[v]}\n" for v in SECRET_VARS))
        return out

    def interpolation_env(self, create: bool = False) -> dict[str, str]:
        # compose: the shell's environment wins over --env-file
        return {**read_env_file(SETTINGS), **self.secrets(create),
                **{k: v for k, v in self.env_in.items() if k not in SECRET_VARS}}

    # ---- ports and paths
    def _ports(self, compose: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """service -> (container port, loopback port), for every service with an exposed port."""
        out = {}
        taken = set()
        for name, svc in compose["services"].items():
            exposed = svc.get("expose") or []
            if not exposed:
                continue
            cport = int(str(exposed[0]).split("/")[0])
            port = self.requested_ports.get(name) or self.state["ports"].get(name) or _free_port(taken)
            taken.add(port)
            out[name] = (cport, int(port))
        unknown = set(self.requested_ports) - set(out)
        if unknown:
            raise StackError(f"--port {sorted(unknown)[0]}=...: not a service with an exposed port; one of {sorted(out)}")
        self.state["ports"] = {k: v[1] for k, v in out.items()}
        return out

    def path_map(self, compose: dict[str, Any]) -> dict[str, str]:
        """Container path -> path here: named volumes into the state dir, bind mounts beside the compose file."""
        out: dict[str, str] = {}
        workdir = _image_workdir()
        if workdir:
            out[workdir] = str(ROOT)
        named = set(compose.get("volumes") or {})
        for name, svc in compose["services"].items():
            for vol in svc.get("volumes") or []:
                src, dst = (vol["source"], vol["target"]) if isinstance(vol, dict) else vol.split(":")[:2]
                here = str(self.dir / "volumes" / src) if src in named else str((INFRA / src).resolve())
                if out.get(dst, here) != here:
                    raise StackError(f"services.{name}.volumes: {dst} is {out[dst]} for another service")
                out[dst] = here
        return out

    def localize(self, text: str, own: str, ports: dict[str, tuple[int, int]], paths: dict[str, str]) -> str:
        for svc, (cport, port) in ports.items():
            text = re.sub(rf"(?<![\w.-]){re.escape(svc)}:{cport}\b", f"127.0.0.1:{port}", text)
        if own in ports:
            cport, port = ports[own]
            text = re.sub(rf"\b(localhost|127\.0\.0\.1|0\.0\.0\.0)([:/]){cport}\b", rf"127.0.0.1\g<2>{port}", text)
        text = text.replace("0.0.0.0", "127.0.0.1")
        for src in sorted(paths, key=len, reverse=True):
            text = re.sub(rf"(?<![\w./-]){re.escape(src)}(?=/|$|[\s\"':;,])", paths[src], text)
        return text

    def plans(self, create: bool = False) -> tuple[dict[str, Any], list[Plan]]:
        compose = load_compose(self.interpolation_env(create))
        ports = self._ports(compose)
        paths = self.path_map(compose)
        one_shot = one_shot_services(compose)
        training_image = self.interpolation_env().get("TRAINGATE_IMAGE")  # its WORKDIR is this checkout
        path_env = os.pathsep.join([str(self.dir / "bin"), str(BIN), str(PG_BIN), "/usr/local/sbin", "/usr/local/bin",
                                    "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        out = []
        for name in start_order(compose):
            svc = compose["services"][name]
            loc = lambda s: self.localize(s, name, ports, paths)  # noqa: E731
            home = self.dir / "home" / name
            env = {"PATH": path_env, "HOME": str(home), "PREFECT_HOME": str(home / "prefect"), "LANG": "C.UTF-8",
                   "PYTHONUNBUFFERED": "1", "MC_CONFIG_DIR": str(home / "mc"),
                   **{k: loc(v) for k, v in service_environment(svc).items()}, **NATIVE_S3_CLIENT_ENV}
            argv = [loc(a) for a in _argv(svc.get("entrypoint")) + _argv(svc.get("command"))]
            cport, port = ports.get(name, (None, None))
            if port is not None:  # `--port 5000` of the service's own command
                argv = [str(port) if a == str(cport) and i and argv[i - 1] == "--port" else a for i, a in enumerate(argv)]
            hc = svc.get("healthcheck") or {}
            test = hc.get("test")
            if isinstance(test, str):
                test = ["CMD-SHELL", test]
            if test and test[0] == "NONE" or hc.get("disable"):
                test = None
            if test:
                test = ["/bin/sh", "-c", loc(test[1])] if test[0] == "CMD-SHELL" else [loc(a) for a in test[1:]]
            interval = _duration_s(hc.get("interval"), 30)
            deadline = _duration_s(hc.get("start_period"), 0) + interval * int(hc.get("retries", 3)) + 10
            kind = NATIVE_IMAGES.get(image_repo(svc.get("image", "")), "command")
            reason = ""
            mounts = [str(v) for v in svc.get("volumes") or []]
            if any(DOCKER_SOCKET in m for m in mounts) and not _docker_engine():
                kind, reason = "skipped", f"needs a Docker engine ({DOCKER_SOCKET} is not a socket here)"
            deps = svc.get("depends_on") or {}
            deps = {d: (c or {}).get("condition", "service_started") for d, c in deps.items()} \
                if isinstance(deps, dict) else {d: "service_started" for d in deps}
            health_env = dict(env)
            if kind == "postgres":
                health_env.update(PGHOST="127.0.0.1", PGPORT=str(port))
            sig = svc.get("stop_signal", "SIGTERM")
            out.append(Plan(
                name=name, kind=kind, argv=argv, env=env, cwd=ROOT if svc.get("image") == training_image else home,
                one_shot=name in one_shot, healthcheck=test, health_env=health_env, interval_s=min(interval, 2.0),
                timeout_s=_duration_s(hc.get("timeout"), 30), deadline_s=max(deadline, 60), port=port,
                container_port=cport, stop_signal=getattr(signal, sig if sig.startswith("SIG") else f"SIG{sig}"),
                grace_s=_duration_s(svc.get("stop_grace_period"), 10), reason=reason, depends_on=deps))
        return compose, out

    # ---- processes
    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.state_file)

    def alive(self, name: str) -> bool:
        rec = self.state["procs"].get(name)
        return bool(rec) and _same_process(rec)

    def up(self, out=sys.stdout) -> dict[str, str]:
        if self.dir.is_relative_to(ROOT):  # the pools' TRAINGATE_STATE_DIR is a volume in it
            raise StackError(f"stack dir {self.dir} is inside the code checkout {ROOT}: flow runs refuse a state dir "
                             "there; give one outside it, e.g. TRAINGATE_STACK_DIR=$HOME/traingate-stack")
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o711 if os.geteuid() == 0 else 0o700)  # postgres (another user) must reach its volume
        compose, plans = self.plans(create=True)
        _let_stop_signals_through({p.stop_signal for p in plans})
        self._write_mc_shim()
        self._save()
        done: dict[str, str] = {}
        for p in plans:
            for dep, cond in p.depends_on.items():
                if done.get(dep) == "skipped":
                    raise StackError(f"{p.name} depends on {dep}, which cannot run here ({cond})")
            (self.dir / "logs").mkdir(exist_ok=True)
            Path(p.env["HOME"]).mkdir(parents=True, exist_ok=True)
            if p.kind == "skipped":
                done[p.name] = "skipped"
                print(f"{p.name}: not started: {p.reason}", file=out)
                continue
            t0 = time.monotonic()
            if p.one_shot:
                self._run_once(p)
                done[p.name] = "completed"
            else:
                if not (self._postgres_running(p) if p.kind == "postgres" else self.alive(p.name)):
                    self._start(p)
                if p.healthcheck:
                    self._wait_healthy(p)
                done[p.name] = "healthy" if p.healthcheck else "started"
            where = f" on 127.0.0.1:{p.port}" if p.port else ""
            print(f"{p.name}: {done[p.name]}{where} ({time.monotonic() - t0:.1f} s)", file=out, flush=True)
        return done

    def _log(self, name: str) -> Path:
        return self.dir / "logs" / f"{name}.log"

    def _start(self, p: Plan) -> None:
        if p.kind == "postgres":
            self._postgres_start(p)
            return
        argv, env = p.argv, p.env
        if p.kind == "s3":
            argv = [sys.executable, str(INFRA / "moto_s3_server.py"), "-H", "127.0.0.1", "-p", str(p.port)]
            env = {**p.env, "TRAINGATE_S3_SERVICE_KEYS": json.dumps(self._s3_service_keys())}
        with self._log(p.name).open("ab") as log:
            proc = subprocess.Popen(argv, env=env, cwd=p.cwd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.state["procs"][p.name] = _record(proc.pid, p)
        self._save()
        if p.kind == "s3":
            self._wait_healthy(p)
            self._s3_restore(p)

    def _run_once(self, p: Plan) -> None:
        with self._log(p.name).open("ab") as log:
            r = subprocess.run(p.argv, env=p.env, cwd=p.cwd, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, timeout=1800)
        if r.returncode != 0:
            raise StackError(f"{p.name} exited {r.returncode}: {self._tail(p.name)}")

    def healthy(self, p: Plan) -> tuple[bool, str]:
        if not p.healthcheck:
            return self.alive(p.name), "no healthcheck"
        try:
            r = subprocess.run(p.healthcheck, env=p.health_env, cwd=p.cwd, capture_output=True, text=True,
                               timeout=p.timeout_s)
        except subprocess.TimeoutExpired:
            return False, f"healthcheck timed out after {p.timeout_s:.0f} s"
        return r.returncode == 0, (r.stdout + r.stderr).strip()[-300:]

    def _wait_healthy(self, p: Plan) -> None:
        deadline = time.monotonic() + p.deadline_s
        while True:
            ok, why = self.healthy(p)
            if ok:
                return
            if p.kind != "postgres" and not self.alive(p.name):
                raise StackError(f"{p.name} exited before it was healthy: {self._tail(p.name)}")
            if time.monotonic() > deadline:
                raise StackError(f"{p.name} not healthy after {p.deadline_s:.0f} s ({why}): {self._tail(p.name)}")
            time.sleep(p.interval_s)

    def _tail(self, name: str, n: int = 1500) -> str:
        log = self._log(name)
        text = log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"
        for v in self.secrets(False).values():
            if v:
                text = text.replace(v, "***")
        return text.replace("\n", " | ")

    def down(self, out=sys.stdout) -> None:
        compose, plans = self.plans()
        for p in reversed(plans):
            if p.kind == "postgres":
                if self._postgres_running(p):
                    t0 = time.monotonic()
                    self._as_postgres([str(PG_BIN / "pg_ctl"), "-D", self._pgdata(), "-m", "fast", "-w", "stop"])
                    print(f"{p.name}: stopped ({time.monotonic() - t0:.1f} s)", file=out)
                self.state["procs"].pop(p.name, None)
                continue
            rec = self.state["procs"].get(p.name)
            if not rec:
                continue
            if p.kind == "s3" and _same_process(rec):
                self._s3_save(p)
            t0 = time.monotonic()
            killed = _stop(rec, p.stop_signal, p.grace_s)
            self.state["procs"].pop(p.name, None)
            self._save()
            how = f"killed after its {p.grace_s:g} s stop grace period" if killed else "stopped"
            print(f"{p.name}: {how} ({time.monotonic() - t0:.1f} s)", file=out)
        self._save()
        for proc in _pool_authorities(self.dir):
            print(f"pool authority {proc.pid}: stopped", file=out)

    def status(self, out=sys.stdout) -> bool:
        compose, plans = self.plans()
        all_ok = True
        for p in plans:
            if p.kind == "skipped":
                print(f"{p.name}: not started: {p.reason}", file=out)
                continue
            if p.one_shot:
                print(f"{p.name}: one-shot (log: {self._log(p.name)})", file=out)
                continue
            running = self._postgres_running(p) if p.kind == "postgres" else self.alive(p.name)
            ok = running and self.healthy(p)[0]
            all_ok &= ok
            where = f" 127.0.0.1:{p.port}" if p.port else ""
            print(f"{p.name}: {'healthy' if ok else 'running, unhealthy' if running else 'stopped'}{where}", file=out)
        return all_ok

    def client_env(self, credentials: bool = False) -> dict[str, str]:
        """What a client on this machine sets to use the stack: its locations, and with ``credentials`` the
        workers' own (the platform identity: Prefect's auth string, MLflow user and password, S3 key,
        the Optuna database's password)."""
        compose, plans = self.plans()
        by = {p.name: p for p in plans}
        worker = next(p for p in plans if "--pool" in p.argv)  # `prefect worker start --pool ...`, wrapped or not
        keys = ("PREFECT_API_URL", "TRAINGATE_TRACKING_URI", "TRAINGATE_CHECKPOINT_URI", "TRAINGATE_S3_ENDPOINT_URL",
                "TRAINGATE_OPTUNA_STORAGE", "TRAINGATE_STATE_DIR", "AWS_DEFAULT_REGION", "TRAINGATE_BUCKET")
        keys += CLIENT_CREDENTIALS if credentials else ()
        out = {k: worker.env[k] for k in keys if k in worker.env}
        out["MLFLOW_S3_ENDPOINT_URL"] = by["mlflow"].env.get("MLFLOW_S3_ENDPOINT_URL", "")
        return {**out, **NATIVE_S3_CLIENT_ENV}

    # ---- native equivalents
    def _pgdata(self) -> str:
        compose, _ = self._compose_paths()
        return compose["/var/lib/postgresql/data"]

    def _compose_paths(self) -> tuple[dict[str, str], dict]:
        compose = load_compose(self.interpolation_env())
        return self.path_map(compose), compose

    def _as_postgres(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            argv = [RUNUSER, "-u", "postgres", "--", *argv]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)
        if r.returncode != 0:
            raise StackError(f"{' '.join(argv[:6])}... exited {r.returncode}: {(r.stdout + r.stderr).strip()[-800:]}")
        return r

    def _postgres_running(self, p: Plan) -> bool:
        pid = Path(self._pgdata()) / "postmaster.pid"
        if not pid.exists():
            return False
        try:
            os.kill(int(pid.read_text().split()[0]), 0)
            return True
        except (OSError, ValueError):
            return False

    def _postgres_start(self, p: Plan) -> None:
        if not (PG_BIN / "initdb").exists():
            raise StackError(f"PostgreSQL 15 is not installed ({PG_BIN / 'initdb'} missing): "
                             "apt-get install -y postgresql (or set TRAINGATE_PG_BIN)")
        data = Path(self._pgdata())
        fresh = not (data / "PG_VERSION").exists()
        data.mkdir(parents=True, exist_ok=True)
        os.chmod(data, 0o700)
        log = self._log(p.name)
        log.touch()
        if os.geteuid() == 0:
            for d in (data, log):
                shutil.chown(d, "postgres", "postgres")
            for parent in data.parents:  # reachable by the postgres user?
                if parent == Path("/"):
                    break
                r = subprocess.run([RUNUSER, "-u", "postgres", "--", "test", "-x", str(parent)])
                if r.returncode != 0:
                    raise StackError(f"the postgres user cannot enter {parent} (mode {oct(parent.stat().st_mode)[-3:]}); "
                                     f"choose a stack dir whose parents are searchable (chmod o+x), or run as a non-root user")
        env = p.env
        if fresh:
            pw = Path(env["HOME"]) / "initdb.pw"  # initdb wants an empty data dir
            fd = os.open(pw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(env["POSTGRES_PASSWORD"] + "\n")
            if os.geteuid() == 0:
                shutil.chown(pw, "postgres", "postgres")
            try:
                self._as_postgres([str(PG_BIN / "initdb"), "-D", str(data), "-U", env["POSTGRES_USER"],
                                   f"--pwfile={pw}", "--auth-host=scram-sha-256", "--auth-local=peer",
                                   "-E", "UTF8", "--locale=C.UTF-8"])
            finally:
                pw.unlink(missing_ok=True)
        self._as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "-o",
                           f"-c listen_addresses=127.0.0.1 -p {p.port} -c unix_socket_directories=''", "start"])
        if fresh:  # the image's entrypoint: POSTGRES_DB, then /docker-entrypoint-initdb.d/*
            client = {**env, "PGHOST": "127.0.0.1", "PGPORT": str(p.port), "PGUSER": env["POSTGRES_USER"],
                      "PGPASSWORD": env["POSTGRES_PASSWORD"]}
            subprocess.run([str(PG_BIN / "createdb"), env["POSTGRES_DB"]], env={**client, "PGDATABASE": "postgres"},
                           check=True, capture_output=True, timeout=60)
            paths, _ = self._compose_paths()
            for dst in sorted(d for d in paths if d.startswith("/docker-entrypoint-initdb.d/")):
                if dst.endswith(".sql"):
                    r = subprocess.run([str(PG_BIN / "psql"), "-v", "ON_ERROR_STOP=1", "--no-psqlrc", "-d",
                                        env["POSTGRES_DB"], "-f", paths[dst]], env=client, capture_output=True,
                                       text=True, timeout=60)
                    if r.returncode != 0:
                        raise StackError(f"{paths[dst]}: {r.stderr.strip()[-500:]}")

    def _s3_service_keys(self) -> dict[str, str]:
        """Each service's S3 key (``S3_<SERVICE>_ACCESS_KEY`` -> its ``S3_<SERVICE>_SECRET_KEY``), root's aside:
        moto's IAM API makes keys of its own choosing, so the S3 server imports these at start."""
        sec = self.secrets(False)
        return {sec[v]: sec[v.replace("_ACCESS_KEY", "_SECRET_KEY")] for v in SECRET_VARS
                if re.fullmatch(r"S3_\w+_ACCESS_KEY", v)}

    def _s3(self, p: Plan):
        import boto3
        sec = self.secrets(False)
        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{p.port}", aws_access_key_id=sec["S3_ACCESS_KEY"],
                            aws_secret_access_key=sec["S3_SECRET_KEY"], region_name="us-east-1")

    def _s3_volume(self) -> Path:
        paths, compose = self._compose_paths()
        minio = next(n for n, s in compose["services"].items() if image_repo(s.get("image", "")) == "minio/minio")
        data = _argv(compose["services"][minio].get("command"))[1]  # `server /data ...`
        return Path(paths[data])

    def _s3_save(self, p: Plan) -> None:
        """moto keeps objects in memory: write every bucket into the s3 volume before it stops."""
        vol = self._s3_volume()
        s3 = self._s3(p)
        tmp = vol.with_name(vol.name + ".saving")
        shutil.rmtree(tmp, ignore_errors=True)
        for b in s3.list_buckets()["Buckets"]:
            (tmp / b["Name"]).mkdir(parents=True, exist_ok=True)
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=b["Name"]):
                for o in page.get("Contents", []):
                    dest = tmp / b["Name"] / o["Key"]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    s3.download_file(b["Name"], o["Key"], str(dest))
        shutil.rmtree(vol, ignore_errors=True)
        if tmp.exists():
            tmp.rename(vol)

    def _s3_restore(self, p: Plan) -> None:
        vol = self._s3_volume()
        if not vol.is_dir():
            return
        s3 = self._s3(p)
        for bucket in sorted(d for d in vol.iterdir() if d.is_dir()):
            s3.create_bucket(Bucket=bucket.name)
            for f in sorted(bucket.rglob("*")):
                if f.is_file():
                    s3.upload_file(str(f), bucket.name, f.relative_to(bucket).as_posix())

    def _write_mc_shim(self) -> None:
        b = self.dir / "bin"
        b.mkdir(exist_ok=True)
        shim = b / "mc"
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} "
                        "mc \"$@\"\n")
        shim.chmod(0o755)


def _mc_iam(alias: dict[str, str]):
    import boto3
    return boto3.client("iam", endpoint_url=alias["url"], aws_access_key_id=alias["key"],
                        aws_secret_access_key=alias["secret"], region_name="us-east-1")


def _as_moto_checks(policy: dict[str, Any]) -> dict[str, Any]:
    """A bucket policy with the same rights under the names moto checks: moto checks a HEAD on a bucket as
    ``s3:HeadBucket`` (AWS and MinIO: ``s3:ListBucket``), and a batch delete (DeleteObjects) as
    ``s3:DeleteObject`` on the bucket's ARN (AWS and MinIO: on each object's)."""
    for st in policy["Statement"]:
        actions = [st["Action"]] if isinstance(st.get("Action"), str) else list(st.get("Action", []))
        resources = [st["Resource"]] if isinstance(st.get("Resource"), str) else list(st.get("Resource", []))
        if "s3:ListBucket" in actions:
            actions.append("s3:HeadBucket")
        if "s3:DeleteObject" in actions:
            resources += [r[:-2] for r in resources if r.endswith("/*") and r[:-2] not in resources]
        st["Action"], st["Resource"] = actions, resources
    return policy


def mc_admin(argv: list[str], aliases: dict[str, dict[str, str]]) -> int:
    """``mc admin policy create|attach`` and ``mc admin user add`` on moto's IAM, which the S3 server
    (infra/moto_s3_server.py) enforces on every request. moto's IAM API cannot take an access key chosen by
    the caller: the server imports the stack's service keys at start (each a user named by its key, with
    no rights), and ``user add`` checks that the key is one of them. A policy is stored as
    ``_as_moto_checks`` gives it."""
    words = [a for a in argv if not a.startswith("--")]
    if len(words) < 3 or words[2] not in aliases:
        print(f"mc admin: expected `admin user|policy ... ALIAS ...` with a known alias, got {argv[:4]}", file=sys.stderr)
        return 1
    iam = _mc_iam(aliases[words[2]])
    if words[:2] == ["user", "add"] and len(words) == 5:
        users = {u["UserName"] for u in iam.list_users()["Users"]}
        keys = iam.list_access_keys(UserName=words[3])["AccessKeyMetadata"] if words[3] in users else []
        if words[3] not in {k["AccessKeyId"] for k in keys}:
            print("mc admin user add: the S3 server was not started with this access key (moto cannot take a "
                  "caller's key): give it in TRAINGATE_S3_SERVICE_KEYS when the server starts", file=sys.stderr)
            return 1
        print(f"Added user `{words[3]}` successfully.")
        return 0
    if words[:2] == ["policy", "create"] and len(words) == 5:
        doc = json.dumps(_as_moto_checks(json.loads(Path(words[4]).read_text())))
        if words[3] not in {p["PolicyName"] for p in iam.list_policies(Scope="Local")["Policies"]}:
            iam.create_policy(PolicyName=words[3], PolicyDocument=doc)
        print(f"Created policy `{words[3]}` successfully.")
        return 0
    if words[:2] == ["policy", "attach"] and len(words) == 5 and argv[-2:-1] == ["--user"]:
        user = words[4]
        arn = next(p["Arn"] for p in iam.list_policies(Scope="Local")["Policies"] if p["PolicyName"] == words[3])
        iam.attach_user_policy(UserName=user, PolicyArn=arn)
        print(f"Attached Policies: [{words[3]}] To User: {user}")
        return 0
    print(f"mc admin: this native stand-in knows `user add`, `policy create` and `policy attach --user`, "
          f"not {argv[:2]}", file=sys.stderr)
    return 1


def mc(argv: list[str]) -> int:
    """The `mc` commands the compose file's create-bucket service runs, on boto3."""
    import boto3
    conf = Path(os.environ.get("MC_CONFIG_DIR", Path.home() / ".mc")) / "aliases.json"
    aliases = json.loads(conf.read_text()) if conf.exists() else {}
    if argv[:1] == ["admin"]:
        return mc_admin(argv[1:], aliases)
    if argv[:2] == ["alias", "set"] and len(argv) == 6:
        conf.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({**aliases, argv[2]: {"url": argv[3], "key": argv[4], "secret": argv[5]}}, f)
        print(f"Added `{argv[2]}` successfully.")
        return 0
    if argv[:1] == ["mb"]:
        target = [a for a in argv[1:] if not a.startswith("-")]
        if len(target) != 1 or "/" not in target[0] or target[0].split("/", 1)[0] not in aliases:
            print(f"mc mb: expected ALIAS/BUCKET of a known alias, got {target}", file=sys.stderr)
            return 1
        alias, bucket = target[0].split("/", 1)
        a = aliases[alias]
        s3 = boto3.client("s3", endpoint_url=a["url"], aws_access_key_id=a["key"], aws_secret_access_key=a["secret"],
                          region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
        if bucket in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
            if "--ignore-existing" not in argv and "-p" not in argv:
                print(f"mc mb: bucket {bucket} exists", file=sys.stderr)
                return 1
        else:
            s3.create_bucket(Bucket=bucket)
        print(f"Bucket created successfully `{target[0]}`.")
        return 0
    print(f"mc: this native stand-in knows `alias set` and `mb`, not {argv[:2]}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- process helpers

def _free_port(taken: set[int]) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


def _docker_engine() -> bool:
    import stat
    try:
        return stat.S_ISSOCK(os.stat(DOCKER_SOCKET).st_mode)
    except OSError:
        return False


def _record(pid: int, p: Plan) -> dict[str, Any]:
    import psutil
    return {"pid": pid, "create_time": psutil.Process(pid).create_time(), "argv": p.argv[:4]}


def _same_process(rec: dict[str, Any]) -> bool:
    import psutil
    try:
        proc = psutil.Process(rec["pid"])
        return abs(proc.create_time() - rec["create_time"]) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pool_authorities(stack_dir: Path, grace_s: float = 10.0) -> list[Any]:
    """Stop the pool authorities of the stack's state dir. A job on a worker starts its pool's authority in a
    session of its own so that it outlives the job; in a container it ends with the worker's container, here
    ``down`` ends it (SIGTERM: it saves its records; SIGKILL after the grace period)."""
    import psutil
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "traingate.capacity.authority" not in argv or "--state-dir" not in argv[:-1]:
            continue
        try:
            state = Path(proc.cwd()) / argv[argv.index("--state-dir") + 1]
        except psutil.Error:
            continue
        if state.resolve().is_relative_to(stack_dir):
            found.append(proc)
    for proc in found:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return found


def _let_stop_signals_through(signals: set[int]) -> None:
    """The services this process starts get their stop signals, however `up` itself was started: an ignored signal
    stays ignored across exec, and a blocked one blocked (a shell's background job ignores SIGINT and SIGQUIT, and
    so do a test runner's workers). A Prefect worker, whose stop signal is SIGINT, would ignore `down` and be
    killed at the end of its 60 s stop grace period. SIGINT gets Python's own handler here (Ctrl-C of `up` still
    stops it), which a started program has reset to the default; another signal its default."""
    for sig in signals | {signal.SIGINT}:
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals | {signal.SIGINT})


def _stop(rec: dict[str, Any], sig: int, grace_s: float) -> bool:
    """``sig`` to the service's process group, SIGKILL after the grace period; then every process that was
    under it (a worker starts each flow run in a session of its own, out of its group). True: the service did
    not end within the grace period and was killed."""
    import psutil
    if not _same_process(rec):
        return False
    root = psutil.Process(rec["pid"])
    tree = [root, *root.children(recursive=True)]
    try:
        os.killpg(rec["pid"], sig)
    except ProcessLookupError:
        pass
    _, alive = psutil.wait_procs([root], timeout=grace_s)
    for proc in alive + tree[1:]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)
    return bool(alive)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["mc"]:
        return mc(argv[1:])
    ap = argparse.ArgumentParser(prog="local-stack", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["up", "down", "status", "env"])
    ap.add_argument("--dir", default=os.environ.get("TRAINGATE_STACK_DIR", ".traingate/stack"),
                    help="state dir (default $TRAINGATE_STACK_DIR or ./.traingate/stack)")
    ap.add_argument("--port", action="append", default=[], metavar="SERVICE=PORT",
                    help="loopback port of a service (default: a free one, kept across up/down)")
    args = ap.parse_args(argv)
    ports = {}
    for item in args.port:
        name, _, port = item.partition("=")
        if not port.isdigit():
            print(f"local-stack: --port {item!r}: expected SERVICE=PORT, e.g. prefect-server=4200", file=sys.stderr)
            return 2
        ports[name] = int(port)
    stack = Stack(Path(args.dir), ports)
    if args.action != "up" and not stack.state_file.exists():
        print(f"local-stack: no stack in {stack.dir}: start one with `up` (or set TRAINGATE_STACK_DIR)", file=sys.stderr)
        return 2
    try:
        if args.action == "up":
            try:
                stack.up()
            except BaseException:
                if stack.state_file.exists():
                    stack.down(out=sys.stderr)  # no half-started stack left behind
                raise
            for k, v in stack.client_env().items():
                print(f"{k}={v}")
            print(f"# secrets: {stack.dir / 'secrets.env'} (mode 0600) unless given in the environment; "
                  "`env` prints a client's settings with its credentials")
        elif args.action == "down":
            stack.down()
        elif args.action == "status":
            return 0 if stack.status() else 1
        else:  # for `eval "$(infra/local-stack.sh env)"`: the values are shell-quoted
            for k, v in stack.client_env(credentials=True).items():
                print(f"export {k}={shlex.quote(v)}")
    except StackError as e:
        print(f"local-stack: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
