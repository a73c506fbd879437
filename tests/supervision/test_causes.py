"""Exit causes that must stop a run, and the limits on restarting: real 2-rank torchrun jobs.

The retryable causes (preempted, worker_lost, hang, collective_timeout, transient_io) are
produced and recovered from in one run by the drill test (test_drill.py).
"""
from __future__ import annotations

import json

import pytest
import yaml


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fault, overrides, cause, status", [
    ("oom@3:1", [], "oom", "failed"),                 # simulated: torch.OutOfMemoryError raised at step 3
    ("nan@3", [], "diverged", "diverged"),            # weights poisoned with NaN: non-finite loss
    ("error@3:0", [], "user_error", "failed"),        # an exception in recipe code
    ("", ["recipe.params.channels=0"], "user_error", "failed"),  # a config the recipe cannot build
], ids=["simulated-oom", "nan-weights", "recipe-exception", "bad-config"])
def test_non_retryable_cause_stops_at_once_with_the_cause_and_the_log_tail(supervised, fault, overrides, cause,
                                                                        status):
    run = supervised(fault, *overrides)
    assert run.causes == [cause], run.log
    assert run.sup.status == status and run.events == []  # one launch: no retry storm
    assert run.sup.error.startswith(f"{cause}: ")
    # the tail holds at least the failing rank's line; the other rank's may not come, as the tree is stopped at once
    assert "--- last " in run.sup.error and len(run.sup.error.splitlines()) >= 3


def test_oom_policy_retries_a_simulated_oom_with_half_the_micro_batch_and_twice_the_accumulation(supervised):
    run = supervised("oom@3:1", "supervision.oom_halve_batch=true")
    assert run.causes == ["oom", None], run.log
    assert run.exits == [0, 1]  # each launch's end said as it ended, before its restart was decided
    assert run.events[0]["overrides"] == ["optim.batch_size=8", "optim.grad_accum=2"]
    relaunched = json.loads((run.stage_dir / "job.json").read_text())  # the last attempt's StageJob
    assert relaunched["attempt"] == 1 and relaunched["restart_cause"] == "oom"
    assert (relaunched["spec"]["optim"]["batch_size"], relaunched["spec"]["optim"]["grad_accum"]) == (8, 2)
    assert run.sup.status == "completed"


def test_a_retryable_fault_beyond_the_retry_budget_stops_with_the_cause_instead_of_restarting(supervised):
    # The budget's counting and wall-clock limits are unit-tested in test_policy.py; here, the wiring.
    run = supervised("kill@3:1", "supervision.max_restarts=0")
    assert run.causes == ["worker_lost"], run.log
    assert run.sup.status == "failed" and run.events == [] and run.exits == [0]
    assert run.sup.error.startswith("worker_lost: ") and "retry budget spent" in run.sup.error
