"""The smoke stage's two halves when a resume continues it: a smoke stage paused before its first
checkpoint (a budget pause that lands during start-up on a busy machine leaves none at all) resumes
into the same halves, so its gate's ``resumed_from_step`` shows a real stop and resume.

Real processes: the stage is resumed through stage_run.train, as the launch task and the Slurm batch
step call it, with real torchrun launches of the tiny digits recipe."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from traingate.job import files
from traingate.job.stagejob import derive
from traingate.job.vocab import Cause, Status
from traingate.ladder import outcomes, stage_run
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision.checkpoints import latest_checkpoint
from traingate.supervision.supervisor import Hooks, read_state

pytestmark = pytest.mark.slow


def test_a_smoke_stage_paused_before_its_first_checkpoint_resumes_into_its_stop_and_resume_halves(tiny_spec, state_dir):
    spec = load_spec(
        tiny_spec("""
        tracking: {enabled: false}
        stages: {smoke: {max_steps: 8}}
        resources: {procs_per_node: 1}
        supervision: {backoff_base_s: 0, backoff_max_s: 0, hang_timeout_s: 120}
        """)
    )
    run_dir = state_dir / "runs" / "smoke-paused"
    job = derive(spec, "smoke", run_id=run_dir.name, run_dir=run_dir, settings=Settings.from_env())
    stage_dir = Path(job.stage_dir)
    stage_dir.mkdir(parents=True)
    # As the budget's pause left it: its one launch stopped during start-up, before a step or a checkpoint.
    paused = time.time() - 60
    files.write_supervisor_state(
        stage_dir,
        files.SupervisorState(
            attempts=[
                {
                    "number": 0,
                    "launched_at": paused,
                    "ended_at": paused + 4,
                    "cause": str(Cause.PREEMPTED),
                    "retryable": True,
                    "detail": "stopped on request",
                    "resume_from_step": None,
                }
            ],
            final={"status": "preempted", "cause": "preempted", "paused_by": "alert budget-exhausted"},
        ),
    )
    assert latest_checkpoint(job.checkpoint_uri)[0] is None

    said: list[str] = []
    before: list = []
    sup = stage_run.train(job, Hooks(info=said.append), read_state(stage_dir), said.append, before)

    assert sup.status == Status.COMPLETED, sup.error
    result = files.read_result(stage_dir)
    assert result is not None and result.resumed_from_step == 4 and result.steps_done == 8
    assert "smoke: part 1 stops at step 4 with a checkpoint; part 2 resumes from it" in said
    # The paused launch, the first half and the second half are all charged with the stage.
    charged = outcomes.from_supervision(job, sup, 1.0, before=before).attempts
    assert [round(a["start"], 3) for a in charged][0] == round(paused, 3) and len(charged) == 3
