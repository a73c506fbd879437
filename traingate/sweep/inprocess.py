"""Run a training stage inside this process: the same Trainer the training process runs, minus the process.

The benchmark uses it so that dozens of trials fit on a 2-core machine (no interpreter
and torch start-up per trial). Pruning hooks into the trainer's ``on_progress``, so a
pruned trial stops at the step the scheduler decided, exactly as the process path does.
Single process, main thread only (the trainer installs a SIGTERM handler).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from traingate.job.stagejob import JobKind, derive
from traingate.runtime.dist import DistInfo
from traingate.runtime.train import Trainer
from traingate.settings import Settings
from traingate.spec import RunSpec


def run_stage(
    spec: RunSpec,
    stage: str,
    out_dir: Path,
    eval_every: int = 0,
    on_progress: Callable[[dict[str, Any]], bool] | None = None,
    checkpoint_uri: str | None = None,
) -> dict[str, Any]:
    """Train ``stage`` of ``spec`` here; returns {status, steps, metrics, duration_s}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    job = derive(
        spec,
        stage,
        run_id=out_dir.name,
        run_dir=out_dir.parent,
        settings=Settings.from_env(),
        kind=JobKind.TRIAL,
        stage_dir=out_dir,
        eval_every=eval_every,
        checkpoint_uri=checkpoint_uri or (out_dir / "checkpoints").as_uri(),
    )
    job = dataclasses.replace(job.launch(time.time()), tracking_uri=None, mlflow_run_id=None)  # not tracked
    d = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    t0 = time.perf_counter()
    trainer = Trainer(job, d)
    trainer.on_progress = on_progress
    try:
        outcome = trainer.run()
    finally:
        trainer.close()
    metrics = {k: v for k, v in outcome.metrics.items() if isinstance(v, (int, float))}
    return {
        "status": outcome.status,
        "steps": outcome.steps_done,
        "metrics": metrics,
        "duration_s": time.perf_counter() - t0,
    }
