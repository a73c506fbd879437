"""Each exit cause, produced for real in a 2-rank torchrun job and seen through the supervisor."""
from __future__ import annotations

import json

import pytest
import yaml


pytestmark = pytest.mark.slow


def _coherent(attempt, resume_from_step: int) -> None:
    """A relaunched group starts every rank from one global step: the latest checkpoint's."""
    assert sorted(attempt.start_steps) == [0, 1]
    assert set(attempt.start_steps.values()) == {resume_from_step}


def test_each_retryable_cause_is_classified_and_the_whole_group_restarts_from_the_latest_checkpoint(supervised):
    # One run, four faults, four launches that each end differently (each fault fires once):
    run = supervised(",".join([
        "term@3",        # preempted: SIGTERM to the tree, emergency checkpoint at step 4, exit 75
        "kill@6:1",      # worker_lost: rank 1 SIGKILLed
        "ctimeout@8:0",  # collective_timeout, simulated: rank 0 raises what a timed-out gloo recv raises
        "io@11",         # transient_io: the checkpoint store fails (EIO) at the save of step 15
    ]))
    assert run.causes == ["preempted", "worker_lost", "collective_timeout", "transient_io", None], run.log
    assert run.sup.status == "completed" and run.sup.attempts[-1].end_step == 16
    assert [e["cause"] for e in run.events] == run.causes[:-1]
    assert [e["resume_from_step"] for e in run.events] == [4, 5, 5, 10]
    assert run.events[0]["steps_lost"] == 0  # the emergency checkpoint kept every step
    for event, relaunched in zip(run.events, run.sup.attempts[1:]):
        _coherent(relaunched, event["resume_from_step"])
    result = json.loads((run.stage_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["resumed_from_step"] == 10


def test_a_sigstopped_rank_is_detected_as_hang_and_the_run_recovers_within_timeout_plus_restart(supervised):
    run = supervised("stop@7:1")
    assert run.causes == ["hang", None], run.log
    assert "stuck" in run.sup.attempts[0].detail
    _coherent(run.sup.attempts[1], run.events[0]["resume_from_step"])
    stopped_at = run.fired()[0]["time"]
    recovered_at = run.sup.attempts[1].first_step_time
    detected_after = run.sup.attempts[0].ended_at - stopped_at
    assert 4.0 <= detected_after < 4.0 + 10.0  # hang_timeout_s = 4, polled every 0.5 s; loaded CI box
    # Recovery = detection (timeout) + backoff + a relaunch (torchrun, imports, resume): generous bound.
    assert recovered_at - stopped_at < 4.0 + 60.0


@pytest.mark.parametrize("fault, overrides, cause, status", [
    ("oom@3:1", [], "oom", "failed"),                 # simulated: torch.OutOfMemoryError raised at step 3
    ("nan@3", [], "diverged", "diverged"),            # weights poisoned with NaN: non-finite loss
    ("error@3:0", [], "user_error", "failed"),        # an exception in recipe code
    ("", ["recipe.params.channels=0"], "user_error", "failed"),  # a config the recipe cannot build
])
def test_non_retryable_cause_stops_at_once_with_the_cause_and_the_log_tail(supervised, fault, overrides, cause,
                                                                        status):
    run = supervised(fault, *overrides)
    assert run.causes == [cause], run.log
    assert run.sup.status == status and run.events == []  # one launch: no retry storm
    assert run.sup.error.startswith(f"{cause}: ")
    assert "--- last " in run.sup.error and len(run.sup.error.splitlines()) > 3


def test_oom_policy_retries_with_half_the_micro_batch_and_twice_the_accumulation(supervised):
    run = supervised("oom@3:1", "supervision.oom_halve_batch=true")
    assert run.causes == ["oom", None], run.log
    assert run.events[0]["overrides"] == ["optim.batch_size=8", "optim.grad_accum=2"]
    relaunched = yaml.safe_load((run.stage_dir / "spec.restart1.yaml").read_text())["optim"]
    assert (relaunched["batch_size"], relaunched["grad_accum"]) == (8, 2)
    assert run.sup.status == "completed"


def test_a_retryable_fault_that_keeps_coming_back_exhausts_the_retry_budget(supervised):
    run = supervised("kill@3:1,kill@4:1", "supervision.max_restarts=1")
    assert run.causes == ["worker_lost", "worker_lost"], run.log
    assert run.sup.status == "failed" and "retry budget spent" in run.sup.error
