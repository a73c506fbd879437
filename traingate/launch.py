"""How a training stage is started: the command and the environment. Pure functions."""
from __future__ import annotations

import os
import time
from pathlib import Path

from traingate.recipes.script import build_command, torchrun_args
from traingate.runtime import env as renv
from traingate.job.world import stage_world
from traingate.runtime.storage import join
from traingate.settings import Settings
from traingate.spec import RunSpec


def checkpoint_uri(spec: RunSpec, settings: Settings, run_id: str, stage: str) -> str:
    return join(spec.checkpoint.uri or settings.checkpoint_uri, run_id, stage)


def stage_command(spec: RunSpec, stage: str, spec_path: Path, python: str,
                  stop_at_step: int | None = None) -> list[str]:
    nodes, nproc = stage_world(spec, stage)
    if spec.recipe.name == "script":
        return build_command(spec, stage, python, nproc, nodes, spec.resources.rdzv_endpoint)
    tail = ["-m", "traingate.runtime.train", "--spec", str(spec_path), "--stage", stage]
    if stop_at_step is not None:
        tail += ["--stop-at-step", str(stop_at_step)]
    if nodes == 1 and nproc == 1:
        return [python, *tail]
    return [python, "-m", "torch.distributed.run", *torchrun_args(nproc, nodes, spec.resources.rdzv_endpoint),
            *tail]


def stage_env(spec: RunSpec, settings: Settings, stage: str, run_id: str, stage_dir: Path,
              mlflow_run_id: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a stage's processes get: identity and every location they need."""
    env = dict(os.environ if base is None else base)
    env.update({
        renv.RUN_ID: run_id, renv.STAGE: stage, renv.OUT_DIR: str(stage_dir),
        renv.CHECKPOINT_URI: checkpoint_uri(spec, settings, run_id, stage),
        renv.LAUNCH_TS: repr(time.time()),
        "TRAINGATE_STATE_DIR": str(settings.state_dir),
        "MLFLOW_TRACKING_URI": settings.tracking_uri,
        "PYTHONUNBUFFERED": "1",
    })
    if settings.s3_endpoint_url:
        env["TRAINGATE_S3_ENDPOINT_URL"] = settings.s3_endpoint_url
    if mlflow_run_id and spec.tracking.enabled:
        env["MLFLOW_RUN_ID"] = mlflow_run_id
    else:
        env.pop("MLFLOW_RUN_ID", None)
    # torchrun sets OMP_NUM_THREADS=1 per worker; a plain single process gets the same, so the
    # smoke stage and bare benchmarks measure the same thing.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
