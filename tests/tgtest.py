"""Constants and helpers shared by tests (import as `from tgtest import ...`; conftest
module names collide between test directories, so nothing is imported from conftest)."""
from __future__ import annotations

import contextlib
import logging
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY_DIGITS = """
identity: {experiment: tests, owner: tester, team: platform, purpose: exercise the ladder in tests}
recipe: {name: digits-cnn, params: {channels: 8, hidden: 32}}
optim: {lr: 0.05, batch_size: 16, seed: 0}
resources: {work_pool: cpu-local, procs_per_node: 2}
stages:
  smoke: {max_steps: 4, max_samples: 64}
  canary: {max_steps: 20}
  full: {max_steps: 16}
gates:
  canary:
    rules:
      - {metric: loss_decrease_fraction, op: ">=", value: 0.05}
      - {metric: nonfinite_steps, op: "==", value: 0}
checkpoint: {every_steps: 5}
tracking: {log_every: 2}
"""


def write_job(spec, stage_dir: Path, *, run_id: str, stage: str = "full", checkpoint_uri: str | None = None,
              tracking_uri: str | None = None, mlflow_run_id: str | None = None,
              restart_cause: str | None = None) -> Path:
    """A StageJob for launching ``python -m traingate.runtime.train --job PATH`` by hand in a test."""
    import dataclasses
    import time

    from traingate.job.stagejob import derive
    from traingate.settings import Settings
    from traingate.spec import load_spec

    spec = load_spec(spec) if isinstance(spec, (str, Path)) else spec
    # Checkpoints beside the stage unless told otherwise: hand-launched tests must not share a location.
    job = derive(spec, stage, run_id=run_id, run_dir=stage_dir.parent, stage_dir=stage_dir,
                 settings=Settings.from_env(), checkpoint_uri=checkpoint_uri or (stage_dir / "checkpoints").as_uri())
    job = dataclasses.replace(job, tracking_uri=tracking_uri, mlflow_run_id=mlflow_run_id, launched_at=time.time(),
                              restart_cause=restart_cause, attempt=1 if restart_cause else 0)
    return job.write()


def stop_tree(proc, first_signal: int, grace_s: float) -> None:
    """Signal ``proc``, then SIGKILL it and every process that was under it (listed before the
    first signal: a worker starts each flow run in a session of its own)."""
    import subprocess

    import psutil
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        proc.send_signal(first_signal)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(30)
    psutil.wait_procs(tree, timeout=30)


def run_processes(run_id: str, state_dir: str | None = None, pids: frozenset[int] = frozenset()) -> list:
    """The live (not zombie) processes of a run: TRAINGATE_RUN_ID in their environment (and, given ``state_dir``,
    that TRAINGATE_STATE_DIR: another copy of the suite at the same time has runs of the same id), or a pid in
    ``pids``. A process forked from a zygote shows the zygote's environment, which carries the run's too."""
    import psutil

    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            env = p.environ()
            ours = env.get("TRAINGATE_RUN_ID") == run_id and state_dir in (None, env.get("TRAINGATE_STATE_DIR"))
            if ours or p.pid in pids:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def describe(processes: list) -> list[str]:
    """pid and command line of each process, for an assertion's message."""
    import psutil

    out = []
    for p in processes:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone meanwhile
            out.append(f"{p.pid} (gone)")
    return out


def tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def wait_healthy(url: str, proc, log: Path, timeout_s: float, what: str) -> None:
    """Poll ``url`` until it answers 200; fail with the server's log if ``proc`` exits or time runs out."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"{what} exited {proc.returncode}: {tail(log)}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{what} not healthy after {timeout_s:.0f} s: {tail(log)}"
        time.sleep(0.5)


# A temporary server keeps its database in SQLite, where a transaction that reads and then writes fails at once
# ("database is locked", answered 503: retry) when another commits in between. On a box busy enough to
# deschedule the server mid-transaction (a second copy of the suite beside this one), with workers polling every
# second and flow runs logging to it, that went on for minutes: Prefect's 5 retries (2 to 32 s apart, about a
# minute) ran out on a run_deployment. Clients of these servers retry 7 times (about 4 minutes).
CLIENT_RETRIES = "7"


@contextlib.contextmanager
def prefect_server(tmp_path: Path):
    """A real `prefect server start` on a free loopback port, its home and SQLite database under
    ``tmp_path``; yields {"url", "env"} (``env``: for the processes that use it, CLIENT_RETRIES included)."""
    import os
    import signal
    import subprocess

    from flows import local_server

    log = tmp_path / "server.log"
    db = tmp_path / "prefect.db"
    # A free port is free only when asked: on a busy machine another process (a second suite, any outgoing
    # connection's ephemeral port) can take it before the server binds. The server then exits: 1 when
    # Prefect's own check sees it ("Port N is already in use"), 3 when uvicorn's bind does ("address already
    # in use", then Prefect's stop of services that never started: "Reactive triggers not started"). That
    # start is retried on a fresh port, as flows/local_server.py does. Any other exit fails at once.
    for attempt in range(1, 4):
        port = free_port()
        url = f"http://127.0.0.1:{port}/api"
        # A copy of the session's migrated database (conftest: TRAINGATE_PREFECT_DB_CACHE) when none is here yet.
        seeding = local_server.seed_database(db, local_server.db_cache_dir(tmp_path))
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": url,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_CLIENT_MAX_RETRIES": CLIENT_RETRIES,
               "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{db}", **seeding.env}
        with log.open("wb") as out:
            proc = subprocess.Popen([str(Path(PYTHON).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                                     "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            wait_healthy(f"{url}/health", proc, log, 180, "prefect server")
            seeding.started()
            break
        except AssertionError:
            port_taken = proc.poll() is not None and "already in use" in log.read_text(errors="replace")
            stop_tree(proc, signal.SIGTERM, 30)
            if attempt == 3 or not port_taken:
                raise
    try:
        yield {"url": url, "env": env}
    finally:
        stop_tree(proc, signal.SIGTERM, 30)


class KeptRecords(logging.Handler):
    """The records of a logger at ``level`` and up, kept in ``records``: Prefect's run loggers do not propagate to
    pytest's caplog, so a test adds this to ``prefect.flow_runs`` to read what a flow run logged."""

    def __init__(self, level: int = logging.INFO):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


def paused_flow_runs(client, since) -> list:
    """The flow runs started after ``since`` (an aware datetime) that are paused now, from ``client`` (sync).
    Asked of the server by state and start time: a session's server holds every flow run of the xdist
    worker's earlier tests, and a page of them in the server's default order (random uuid4 ids) need not
    hold the one a test waits for."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterStartTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    paused = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])),
                           start_time=FlowRunFilterStartTime(after_=since))
    return [fr for fr in client.read_flow_runs(flow_run_filter=paused) if fr.state is not None and fr.state.is_paused()]


def wait_paused_for_input(client, since, besides: set = frozenset(), timeout_s: float = 300,
                          described: bool = False) -> tuple:
    """The flow run started after ``since`` that paused for a Resume form, and that pause's keyset, once it pauses
    (a pause whose response key is in ``besides`` does not count: the same run paused again) and its form's
    schema (``described``: and its description) is stored: Prefect sets the Paused state first and saves the form
    after it, schema then description."""
    import time

    from prefect.exceptions import PrefectHTTPStatusError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for fr in paused_flow_runs(client, since):
            keyset = fr.state.state_details.run_input_keyset
            if keyset and keyset["response"] not in besides:
                try:
                    for key in ("schema", "description") if described else ("schema",):
                        client.read_flow_run_input(fr.id, keyset[key])
                except PrefectHTTPStatusError as e:
                    if e.response.status_code != 404:
                        raise
                    continue  # paused, its form not saved yet
                return fr, keyset
        time.sleep(1)
    raise AssertionError(f"no flow run paused for its Resume form within {timeout_s:.0f} s")


@contextlib.contextmanager
def prefect_api_at(url: str, **more):
    """This process's Prefect clients on the server at ``url`` for the block (``more``: further settings by
    name, e.g. ``PREFECT_API_AUTH_STRING``; the client retries CLIENT_RETRIES times unless ``more`` says otherwise):
    ``temporary_settings`` plus what it does not do. Prefect's events
    and log workers are per process and keep the API they were started with, so they are drained on the
    way in and out. Without that, an event or a flow's log after the block goes to this server once it has
    stopped, and every later in-process emitter on this xdist worker queues behind their retries."""
    import prefect.settings
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    def rebind() -> None:
        EventsWorker.drain_all(timeout=10)
        APILogWorker.drain_all(timeout=10)

    rebind()
    more = {"PREFECT_CLIENT_MAX_RETRIES": int(CLIENT_RETRIES), **more}
    updates = {prefect.settings.PREFECT_API_URL: url, **{getattr(prefect.settings, k): v for k, v in more.items()}}
    with prefect.settings.temporary_settings(updates=updates):
        try:
            yield
        finally:
            rebind()  # while this server still answers: what the block emitted reaches it


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any location: only a pool gives them."""
    import os

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINGATE_", "MLFLOW_")) or k == "TRAINGATE_PREFECT_SERVER"}  # not a location
    return {**env, "PATH": f"{Path(PYTHON).parent}{os.pathsep}{env.get('PATH', '')}", **extra}


@contextlib.contextmanager
def pool_worker(tmp: Path, server: dict, code: Path, deployments: list[str], worker_cwd: Path,
                worker_env: dict[str, str] | None = None, before_worker=None):
    """On ``server``: the cpu-local pool bootstrapped as `traingate pools bootstrap` does (state dir
    ``tmp/pool-state``), ``deployments`` of deployments/prefect.yaml deployed from ``code``, and a process
    worker polling every 2 s; yields {"env", "pool_state", "worker_log", "mlflow"}."""
    import signal
    import subprocess

    from mlflow.tracking import MlflowClient

    bin_dir = Path(PYTHON).parent
    pool_state = tmp / "pool-state"
    (tmp / "pools.yaml").write_text("pools:\n  cpu-local: {gpus_per_node: 2, nodes: 1, price_per_gpu_hour: 0.05, "
                                    "worker: process}\n")
    env = clean_env(PREFECT_API_URL=server["url"], PREFECT_HOME=server["env"]["PREFECT_HOME"],
                    PREFECT_SERVER_ANALYTICS_ENABLED="false", TRAINGATE_CODE_DIR=str(code))
    # The production stack's shared settings name the state dir; the bootstrap hands it to the pool.
    boot = subprocess.run([PYTHON, "-m", "flows.cli", "pools", "bootstrap", str(tmp / "pools.yaml")], cwd=tmp,
                          env={**env, "TRAINGATE_STATE_DIR": str(pool_state)}, capture_output=True, text=True,
                          timeout=300)
    assert boot.returncode == 0, boot.stdout + boot.stderr
    names = [w for name in deployments for w in ("--name", name)]
    p = subprocess.run([str(bin_dir / "prefect"), "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml",
                        *names], env=env, cwd=code, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    if before_worker is not None:
        before_worker()
    log = tmp / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [str(bin_dir / "prefect"), "worker", "start", "--pool", "cpu-local", "--type", "process"],
            env={**env, **(worker_env or {}), "PREFECT_WORKER_QUERY_SECONDS": "2"}, cwd=worker_cwd, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield {"env": env, "pool_state": pool_state, "worker_log": log,
               "mlflow": MlflowClient(f"sqlite:///{pool_state}/mlflow.db")}
    finally:
        stop_tree(worker, signal.SIGINT, 20)
