"""Constants and helpers shared by tests (import as `from tgtest import ...`; conftest
module names collide between test directories, so nothing is imported from conftest)."""
from __future__ import annotations

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
