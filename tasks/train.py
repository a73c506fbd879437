"""A training stage: one torchrun (or plain) process tree, started and watched to its end."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from traingate import launch, outcomes, proc
from traingate.settings import Settings
from traingate.spec import RunSpec
from traingate.stage import StageResult


@task(name="train-stage", cache_policy=NONE, retries=0)
def run_training_stage(spec: RunSpec, stage: str, run_id: str, spec_path: str, stage_dir: str,
                       mlflow_run_id: str | None) -> StageResult:
    log = get_run_logger()
    settings = Settings.from_env()
    out = Path(stage_dir)
    out.mkdir(parents=True, exist_ok=True)
    limits = getattr(spec.stages, stage)
    env = launch.stage_env(spec, settings, stage, run_id, out, mlflow_run_id)
    t0 = time.monotonic()

    if spec.recipe.name == "script":
        s = spec.recipe.script
        assert s is not None
        cmd = launch.stage_command(spec, stage, Path(spec_path), sys.executable)
        log.info("%s: %s", stage, " ".join(cmd))
        res = proc.run(cmd, env, s.workdir, out / "stdout.log", timeout_s=min(limits.timeout_s, s.timeout_s),
                       on_line=log.info)
        return outcomes.from_script(spec, stage, res, out, (out / "stdout.log").read_text(errors="replace"), cmd)

    if stage == "smoke":
        # Prove the wiring end to end: stop half way with a checkpoint, then resume and finish.
        half = max(1, limits.max_steps // 2)
        cmd = launch.stage_command(spec, stage, Path(spec_path), sys.executable, stop_at_step=half)
        log.info("%s (part 1, stop at step %d): %s", stage, half, " ".join(cmd))
        first = proc.run(cmd, env, out, out / "stdout.log", timeout_s=limits.timeout_s, on_line=log.info)
        if first.returncode != 0:
            return outcomes.from_runtime(spec, stage, first, out, time.monotonic() - t0)
        env = launch.stage_env(spec, settings, stage, run_id, out, mlflow_run_id)
    cmd = launch.stage_command(spec, stage, Path(spec_path), sys.executable)
    log.info("%s: %s", stage, " ".join(cmd))
    res = proc.run(cmd, env, out, out / "stdout.log", timeout_s=limits.timeout_s, on_line=log.info)
    return outcomes.from_runtime(spec, stage, res, out, time.monotonic() - t0)
