"""A resumed stage's summary is the stage's: its loss curve, non-finite steps and gradient peak since step 0,
carried in the checkpoints (traingate.runtime.stagestats), not its last process's. The canary gate reads
``loss_decrease_fraction`` from it: measured over a preempted canary's second half only, it falls below a
rule the stage as a whole meets (0.004 against 0.05 in one run). Real training processes killed and
resumed report the uninterrupted stage's summary too: the resume drills of tests/runtime/test_train.py
check it."""

from __future__ import annotations

import json
import random

import pytest

from traingate.runtime.stagestats import StageStats


@pytest.mark.parametrize("steps", [1, 3, 7, 20, 41])
def test_stage_stats_resumed_at_any_step_summarise_like_an_uninterrupted_stage(steps):
    rnd = random.Random(steps)
    series = [(rnd.uniform(0.1, 3.0), rnd.uniform(0.0, 5.0), rnd.random() > 0.1) for _ in range(steps)]
    whole = StageStats()
    for loss, gnorm, finite in series:
        whole.observe(loss, gnorm, finite)
    for cut in range(steps + 1):
        first = StageStats()
        for loss, gnorm, finite in series[:cut]:
            first.observe(loss, gnorm, finite)
        # Through JSON: a checkpoint holds plain lists and numbers only (loaded with weights_only=True).
        resumed = StageStats.from_state(json.loads(json.dumps(first.state_dict())))
        for loss, gnorm, finite in series[cut:]:
            resumed.observe(loss, gnorm, finite)
        assert resumed.summary() == whole.summary(), cut


def test_stage_stats_from_a_checkpoint_without_them_start_at_its_step():
    assert StageStats.from_state(None).summary() == {"nonfinite_steps": 0, "max_grad_norm": 0.0}
