"""One real tiny training run, recorded: the metric series the alert-rule tests feed to the rules."""
from __future__ import annotations

import dataclasses
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tgtest import PYTHON, ROOT, write_job

SPEC = """
identity: {experiment: monitor-tests, owner: tester, team: platform, purpose: record real series for alert rules}
recipe: {name: digits-cnn, params: {channels: 8, hidden: 32}}
optim: {lr: 0.05, batch_size: 16, seed: 0}
resources: {work_pool: cpu-local, procs_per_node: 2}
stages:
  full: {max_steps: %(steps)d}
checkpoint: {every_steps: 20, async_save: false}
tracking: {log_every: 1}
"""


@dataclass
class Recorded:
    """The series of one finished run, as MLflow and the checkpoint store hold them."""
    metrics: dict[str, list[tuple[int, float]]]          # key -> [(step, value)]
    timestamps: dict[str, list[tuple[float, int]]]       # key -> [(epoch seconds, step)]
    checkpoint_times: list[float]
    launched_at: float
    tracking_uri: str
    run_id: str
    val: list[tuple[int, float]] = field(default_factory=list)


def record_run(tmp: Path, steps: int = 140, eval_every: int = 10) -> Recorded:
    from mlflow.tracking import MlflowClient

    from traingate.job.stagejob import StageJob
    from traingate.runtime.checkpoint import Checkpointer

    tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    c = MlflowClient(tracking_uri)
    exp = c.create_experiment("monitor-tests", artifact_location=(tmp / "mlartifacts").as_uri())
    run_id = c.create_run(exp, run_name="recorded").info.run_id
    spec = tmp / "spec.yaml"
    spec.write_text(SPEC % {"steps": steps})
    stage_dir = tmp / "run" / "full"
    job_path = write_job(spec, stage_dir, run_id="monitor-recorded", tracking_uri=tracking_uri, mlflow_run_id=run_id)
    job = dataclasses.replace(StageJob.read(job_path), eval_every=eval_every)
    job.write()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--log-dir={tmp / 'torchelastic'}", "-m", "traingate.runtime.train", "--job", str(job_path)]
    with open(tmp / "train.log", "wb") as log:
        proc = subprocess.run(cmd, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, (tmp / "train.log").read_text()[-3000:]
    keys = ["train_loss", "grad_norm", "step_time_s", "data_wait_s", "val_loss",
            "system/rank0/step_time_s", "system/rank1/step_time_s"]
    history = {k: sorted(c.get_metric_history(run_id, k), key=lambda m: m.step) for k in keys}
    ck = Checkpointer(job.checkpoint_uri, async_save=False)
    return Recorded(
        metrics={k: [(m.step, m.value) for m in h] for k, h in history.items() if k != "val_loss"},
        timestamps={k: [(m.timestamp / 1000.0, m.step) for m in h] for k, h in history.items()},
        checkpoint_times=[float(ck.manifest(s)["created"]) for s in ck.list_steps()],
        launched_at=float(job.launched_at), tracking_uri=tracking_uri, run_id=run_id,
        val=[(m.step, m.value) for m in history["val_loss"]])
