"""A resumed stage's summary is the stage's: its loss curve, non-finite steps and gradient peak since step 0,
carried in the checkpoints (traingate.runtime.stagestats), not its last process's. The canary gate reads
``loss_decrease_fraction`` from it: measured over a preempted canary's second half only, it was 0.004
against a 0.05 rule."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import pytest
from tgtest import TINY_DIGITS, write_job

from traingate.job.stagejob import StageJob
from traingate.runtime.stagestats import StageStats

SUMMARY = ("first_loss", "final_loss", "loss_decrease_fraction", "nonfinite_steps", "max_grad_norm")


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


# One interpreter runs the launches in turn (the training stack imported once); each result.json is printed.
LAUNCHES = """
import json, sys
from pathlib import Path
from traingate.runtime import train
for job in sys.argv[1:]:
    code = train.main(["--job", job])
    assert code == 0, (job, code)
    print("RESULT " + (Path(job).parent / "result.json").read_text().replace(chr(10), " "), flush=True)
"""


def test_a_stage_stopped_at_step_10_and_resumed_reports_the_loss_decrease_of_all_20_steps(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY_DIGITS.replace("tracking: {log_every: 2}", "tracking: {enabled: false}"))
    ref = write_job(spec, tmp_path / "ref" / "canary", run_id="ref", stage="canary")
    resume = write_job(spec, tmp_path / "split" / "canary", run_id="split", stage="canary")
    # The first process stops at step 10 with a checkpoint (as a preemption's emergency checkpoint does);
    # the second resumes from it in the same stage directory and trains to step 20.
    stop = resume.with_name("stop.json")
    stop.write_text(json.dumps(dataclasses.replace(StageJob.read(resume), stop_at_step=10).to_dict()))
    p = subprocess.run(
        [sys.executable, "-c", LAUNCHES, str(ref), str(stop), str(resume)], capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    whole, part1, part2 = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert part1["status"] == "stopped" and part1["steps_done"] == 10, part1
    assert part2["status"] == "completed" and part2["resumed_from_step"] == 10 and part2["steps_done"] == 20, part2
    assert {k: part2["metrics"][k] for k in SUMMARY} == {k: whole["metrics"][k] for k in SUMMARY}
    assert whole["metrics"]["loss_decrease_fraction"] > 0.05  # the rule the canary's gate holds the stage to
