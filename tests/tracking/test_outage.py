"""Nothing lost: the tracking server goes away mid-run and comes back; training carries on, every step arrives."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tgtest import PYTHON, free_port
from tracking_helpers import heartbeat, new_run, start_training, steps_of, train_env, wait_until, write_spec

STEPS = 1000


class MlflowServer:
    """A real `mlflow server` on a loopback port, with its SQLite store and artifacts in a temp dir."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        cmd = [str(Path(PYTHON).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.root}/db.sqlite",
               "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        # Its own session, so stopping it stops its uvicorn worker too.
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, start_new_session=True,
                                     stdout=open(self.root / "server.log", "ab"), stderr=subprocess.STDOUT)
        wait_until(self.healthy, 180, "mlflow server to answer /health", self.proc)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        wait_until(lambda: not self.healthy(), 30, "mlflow server to stop answering")


@pytest.fixture
def mlflow_server(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    server = MlflowServer(tmp_path / "mlflow-server")
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.stop()


@pytest.mark.slow
def test_tracking_server_down_for_over_ten_seconds_mid_run_loses_no_metric_step(tmp_path, mlflow_server):
    run_id = new_run(mlflow_server.uri)
    client = MlflowClient(mlflow_server.uri)
    spec = write_spec(tmp_path / "spec.yaml", STEPS, checkpoint_every=500)
    stage = tmp_path / "stage"
    log = tmp_path / "train.log"
    p = start_training(spec, train_env(mlflow_server.uri, run_id, stage), log)
    wait_until(lambda: len(steps_of(client, run_id, "train_loss")) >= 30, 180, "the first metrics to arrive", p)

    mlflow_server.stop()
    down_at_step = heartbeat(stage)["step"]
    time.sleep(11)
    assert heartbeat(stage)["step"] > down_at_step  # training went on without its tracking store
    assert "tracking store unreachable" in log.read_text()
    mlflow_server.start()

    assert p.wait(300) == 0, log.read_text()[-3000:]
    assert json.loads((stage / "result.json").read_text())["status"] == "completed"
    assert down_at_step < STEPS  # the outage began mid-run
    for key in ("train_loss", "lr", "samples_per_s", "system/rank0/rss_mb"):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == list(range(1, STEPS + 1)), key
        stamps = [m.timestamp for m in history]
        assert stamps == sorted(stamps), key  # in order
    assert "reachable again" in log.read_text()
