"""A training stage: one torchrun (or plain) process tree, supervised to its end.

The restart policy lives in :mod:`traingate.supervision`; this task plugs Prefect into it:
restarts become ``traingate.run.restarted`` events (Automations can act on them), a stale
checkpoint becomes a ``traingate.checkpoint.stale`` event, and cancelling the flow run
preempts the tree (SIGTERM, grace for the emergency checkpoint, SIGKILL) and returns a
``preempted`` StageResult: the calling flow records it and should end with
``Cancelled(message=result.error)`` so the run shows as cancelled, resumable.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NONE
from prefect.events import emit_event
from prefect.runtime import flow_run

from traingate import launch, outcomes, proc
from traingate.settings import Settings
from traingate.spec import RunSpec
from traingate.stage import StageResult
from traingate.supervision.supervisor import Hooks, read_state, supervise

CANCEL_POLL_S = 2.0


@task(name="train-stage", cache_policy=NONE, retries=0)
def run_training_stage(spec: RunSpec, stage: str, run_id: str, spec_path: str, stage_dir: str,
                       mlflow_run_id: str | None, resume: bool = False) -> StageResult:
    """Train one stage. ``resume``: continue an interrupted stage from its latest checkpoint."""
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

    previous = read_state(out) if resume else None
    if stage == "smoke" and previous is None:
        # Prove the wiring end to end: stop half way with a checkpoint, then resume and finish.
        half = max(1, limits.max_steps // 2)
        cmd = launch.stage_command(spec, stage, Path(spec_path), sys.executable, stop_at_step=half)
        log.info("%s (part 1, stop at step %d): %s", stage, half, " ".join(cmd))
        first = proc.run(cmd, env, out, out / "stdout.log", timeout_s=limits.timeout_s, on_line=log.info)
        if first.returncode != 0:
            return outcomes.from_runtime(spec, stage, first, out, time.monotonic() - t0)
        env = launch.stage_env(spec, settings, stage, run_id, out, mlflow_run_id)

    with get_client(sync_client=True) as client:
        hooks = Hooks(on_line=log.info, info=log.info,
                      on_restart=lambda e: _emit("traingate.run.restarted", run_id, stage, e),
                      on_alert=lambda name, e: _emit(f"traingate.{name}", run_id, stage, e),
                      stop_requested=_cancel_watch(client))
        sup = supervise(spec, stage, Path(spec_path), out, env, sys.executable, hooks, resumed=previous)
    result = outcomes.from_runtime(spec, stage, sup.proc, out, time.monotonic() - t0)
    result.status = sup.status
    result.error = sup.error
    result.metrics["restarts"] = sup.restarts
    result.details["supervision"] = sup.to_dict()
    if sup.error:
        log.error("%s: %s", stage, sup.error)
    return result


def _emit(event: str, run_id: str, stage: str, payload: dict[str, Any]) -> None:
    emit_event(event=event, resource={"prefect.resource.id": f"traingate.run.{run_id}",
                                      "traingate.stage": stage}, payload=payload)


def _cancel_watch(client: Any) -> Callable[[], str | None]:
    """A poll of this flow run's state: a reason once it is being cancelled, else None.

    A flow run cancelled from the UI/API while it runs in this process gets no signal
    (only a worker's runner would send one), so the supervisor asks.
    """
    run_id = flow_run.id
    last = [0.0]

    def check() -> str | None:
        if not run_id or time.monotonic() - last[0] < CANCEL_POLL_S:
            return None
        last[0] = time.monotonic()
        state = client.read_flow_run(run_id).state
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            return f"flow run {run_id} is {state.name.lower()}"
        return None
    return check
