"""Constants and helpers shared by tests (import as `from tgtest import ...`; conftest
module names collide between test directories, so nothing is imported from conftest)."""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def prefect_server(tmp_path: Path):
    """A real `prefect server start` on a free loopback port, its home and SQLite database under
    ``tmp_path``; yields {"url", "env"}."""
    import os
    import signal
    import subprocess

    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": url,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"}
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(Path(PYTHON).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_healthy(f"{url}/health", proc, log, 180, "prefect server")
        yield {"url": url, "env": env}
    finally:
        stop_tree(proc, signal.SIGTERM, 30)
