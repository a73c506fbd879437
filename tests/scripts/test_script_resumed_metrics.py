"""A script stage preempted, recorded, resumed and recorded again in the same MLflow stage run (what a
ladder does around a cancel and `traingate resume`): its metrics carry the step and time they were read,
and the gate and the registered model version use the resumed attempt's final val_loss, not the first
attempt's larger one. Real MLflow (SQLite), the real supervisor, an unmodified script."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from scripts.test_script_jobs import PROJECTS, Tracked, copy_project, script_spec
from traingate.job import files
from traingate.job.vocab import Status
from traingate.ladder import outcomes
from traingate.ladder.gates import decide
from traingate.promotion.aliases import model_name
from traingate.promotion.register import register_candidate
from traingate.supervision.supervisor import Hooks, read_state, supervise
from traingate.tracking import runs

SCRIPT = {
    "command": ["python", "train.py", "--out", "${TRAINGATE_CHECKPOINT_DIR}"],
    "stage_args": {"full": ["--steps", "60"]},
    "resume_args": ["--resume"],
    "checkpoints": "state.json",
    "metrics": [r"eval step (?P<step>\d+) val_loss (?P<val_loss>[0-9.]+)"],
}


@pytest.mark.slow
def test_a_resumed_script_stage_is_gated_and_registered_on_its_latest_attempts_improved_val_loss(tmp_path, state_dir):
    workdir = copy_project(tmp_path, PROJECTS / "val_curve")
    spec = script_spec(
        workdir,
        SCRIPT,
        data={"uri": workdir.as_uri()},
        gates={
            "canary": {"rules": [{"metric": "nonfinite_steps", "op": "==", "value": 0}]},
            "full": {"rules": [{"metric": "val_loss", "op": "<", "value": 0.03}]},
        },
    )
    tracked = Tracked(spec)
    job = tracked.job(spec)
    stage_dir = Path(job.stage_dir)

    def preempt_after_step_20() -> str | None:
        points = files.read_script_points(stage_dir)
        return "the test preempts it" if any(p.step >= 20 for p in points) else None

    t0 = time.time()
    first = supervise(job, Hooks(info=lambda _: None, stop_requested=preempt_after_step_20), seed=0)
    assert first.status == Status.PREEMPTED, first.error
    partial = outcomes.from_supervision(job, first, time.time() - t0)
    assert partial.metrics["val_loss"] == pytest.approx(1 / 20, abs=1e-6)  # larger: 1/step
    runs.record_stage(tracked.client, tracked.stage_run, partial, decide(partial, spec.gate("full")))

    second = supervise(job, Hooks(info=lambda _: None), seed=0, resumed=read_state(stage_dir))
    assert second.status == Status.COMPLETED, second.error
    result = outcomes.from_supervision(job, second, time.time() - t0)
    assert result.metrics["val_loss"] == pytest.approx(1 / 60, abs=1e-6) and result.metrics["steps"] == 60
    decision = decide(result, spec.gate("full"))
    assert decision.passed, decision.reasons
    runs.record_stage(tracked.client, tracked.stage_run, result, decision)

    c = tracked.client
    assert c.get_run(tracked.stage_run).data.metrics["stage.val_loss"] == pytest.approx(1 / 60, abs=1e-6)
    [latest] = [m for m in c.get_metric_history(tracked.stage_run, "stage.val_loss") if m.step == 60]
    assert latest.timestamp >= t0 * 1000  # its real time, not 0
    curve = sorted((m.step, m.value) for m in c.get_metric_history(tracked.stage_run, "val_loss"))
    assert curve[-1] == (60, pytest.approx(1 / 60, abs=1e-6))
    assert all(m.timestamp >= t0 * 1000 for m in c.get_metric_history(tracked.stage_run, "val_loss"))

    out = register_candidate(c, spec, tracked.stage_run, result.checkpoint_uri)
    assert out["registered"], out
    version = c.get_model_version(model_name(spec), out["version"])
    assert float(version.tags["traingate.val_loss"]) == pytest.approx(1 / 60, abs=1e-6)
