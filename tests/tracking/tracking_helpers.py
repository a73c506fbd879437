"""Launching real training processes against a real MLflow store, for the tracking tests."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from mlflow.tracking import MlflowClient

from tgtest import PYTHON, ROOT, write_job

SPEC = """
identity: {experiment: tracking-tests, owner: tester, team: platform, purpose: exercise the tracking contract}
recipe: {name: digits-cnn, params: {channels: 16, hidden: 64}}
optim: {lr: 0.01, batch_size: 64, seed: 0}
resources: {work_pool: cpu-local, procs_per_node: 1}
stages:
  full: {max_steps: %(steps)d}
checkpoint: {every_steps: %(every)d}
tracking: {log_every: 1}
"""


def write_spec(path: Path, steps: int, checkpoint_every: int = 25) -> Path:
    path.write_text(SPEC % {"steps": steps, "every": checkpoint_every})
    return path


@functools.lru_cache(maxsize=1)
def _template_store() -> Path:
    """An empty, migrated MLflow SQLite store, made once per test session (migrating one costs seconds)."""
    path = Path(tempfile.mkdtemp(prefix="traingate-mlflow-template-")) / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def fresh_store(db: Path) -> str:
    """A new empty MLflow store at ``db`` (a copy of the session's template); returns its tracking URI."""
    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_template_store(), db)
    return f"sqlite:///{db}"


def new_run(tracking_uri: str, experiment: str = "tracking-tests") -> str:
    c = MlflowClient(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    # With a SQLite store, artifacts go next to it (MLflow's default, ./mlruns, is the cwd);
    # a tracking server keeps its own artifact root.
    location = None
    if tracking_uri.startswith("sqlite:///"):
        location = (Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    exp_id = exp.experiment_id if exp else c.create_experiment(experiment, artifact_location=location)
    return c.create_run(exp_id, run_name="stage-under-test").info.run_id


def train_env(tracking_uri: str, run_id: str | None, stage_dir: Path, **extra: str) -> dict[str, str]:
    """What a hand-launched training process gets; ``start_training`` turns it into its StageJob."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINGATE_RESTART_CAUSE",)}
    env.update({"MLFLOW_TRACKING_URI": tracking_uri, "TRAINGATE_STAGE_DIR": str(stage_dir),
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    if run_id:
        env["MLFLOW_RUN_ID"] = run_id
    env.update(extra)
    return env


def start_training(spec: Path, env: dict[str, str], log: Path, nproc: int = 1) -> subprocess.Popen:
    job = write_job(spec, Path(env["TRAINGATE_STAGE_DIR"]), run_id="tracking-test",
                    tracking_uri=env["MLFLOW_TRACKING_URI"], mlflow_run_id=env.get("MLFLOW_RUN_ID"),
                    restart_cause=env.get("TRAINGATE_RESTART_CAUSE"))
    tail = ["-m", "traingate.runtime.train", "--job", str(job)]
    cmd = [PYTHON, *tail] if nproc == 1 else \
        [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         f"--log-dir={log.parent / 'torchelastic'}", *tail]
    return subprocess.Popen(cmd, env=env, cwd=spec.parent, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def heartbeat(stage_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((stage_dir / "heartbeat.rank0.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def steps_of(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]
