"""Every retryable cause in one run, as `traingate drill` injects them: each is classified, the whole
group restarts from one global step, and the final weights equal the undisturbed run's bit for bit."""
from __future__ import annotations

import json

import pytest

from traingate.supervision.drill import EXPECTED_CAUSE

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 6.0
DRILL_SPEC = f"""
stages:
  full: {{max_steps: 30}}
checkpoint: {{every_steps: 4}}
tracking: {{enabled: false, log_every: 2}}
supervision: {{backoff_base_s: 0.2, backoff_max_s: 1.0, hang_timeout_s: {HANG_TIMEOUT_S}}}
"""


def test_drill_with_five_faults_of_five_kinds_recovers_each_and_ends_with_bitwise_equal_weights(
        tiny_spec, state_dir, tmp_path, capsys):
    from flows.cli import main as cli

    report_path = tmp_path / "drill.json"
    # Seed 1 plans: stop@8:0 (hang), io@11 (EIO at the save of step 12, seen at step 16),
    # ctimeout@21:0 (simulated collective timeout), kill@23:1 (SIGKILL), term@28 (SIGTERM to the tree).
    rc = cli(["drill", str(tiny_spec(DRILL_SPEC)), "--faults", "5", "--seed", "1",
              "--kinds", "kill,term,stop,io,ctimeout", "--json", str(report_path)])
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert rc == 0, out
    assert report["passed"] and report["weights_equal"] and report["mismatched"] == []
    assert {f["kind"] for f in report["faults"]} == set(EXPECTED_CAUSE)
    assert report["recoveries"] == 5
    for f in report["faults"]:  # each fault ended a launch of its own, was named right, and was recovered from
        assert f["classified_as"] == EXPECTED_CAUSE[f["kind"]], f
        assert f["recovery_s"] is not None and f["recovery_s"] > 0
    hang = next(f for f in report["faults"] if f["kind"] == "stop")
    # Detection takes the hang timeout; then backoff and a relaunch (generous: a loaded 2-core box).
    assert HANG_TIMEOUT_S <= hang["recovery_s"] < HANG_TIMEOUT_S + 90
    term = next(f for f in report["faults"] if f["kind"] == "term")
    assert term["steps_lost"] == 0  # the emergency checkpoint kept every step
    assert report["steps_executed"] > report["steps"] == 30 and 0 < report["goodput"] < 1

    # Worker-group recovery: every relaunch started all ranks from one global step.
    (state,) = [json.loads(p.read_text()) for p in state_dir.glob("drills/*/drill/supervisor.json")]
    relaunches = state["attempts"][1:]
    assert len(relaunches) == 5
    for attempt in relaunches:
        assert sorted(attempt["start_steps"]) == ["0", "1"] and len(set(attempt["start_steps"].values())) == 1
    assert "drill PASSED" in out and "bitwise equal" in out and "goodput" in out


def test_drill_refuses_a_plan_that_does_not_fit_the_stage(tiny_spec, state_dir, capsys):
    from flows.cli import main as cli

    assert cli(["drill", str(tiny_spec(DRILL_SPEC)), "--faults", "20"]) == 2
    assert "do not fit in 30 steps" in capsys.readouterr().out


def test_a_killed_rank_is_matched_to_the_launch_it_ended_when_rank_0_last_reported_the_step_before():
    # The record of a drill on a busy machine: rank 1 killed itself at step 23 while rank 0's last report was 22;
    # the next launch resumed from step 20 and was ended by a SIGTERM at 28.
    from types import SimpleNamespace

    from traingate.job.vocab import Cause
    from traingate.supervision.attempts import Attempt
    from traingate.supervision.drill import records

    def attempt(number, start, end, cause, at):
        return Attempt(number, at, at + 5, cause=cause, start_steps={0: start}, end_step=end)

    sup = SimpleNamespace(attempts=[
        attempt(0, 0, 21, Cause.COLLECTIVE_TIMEOUT, 0.0),
        attempt(1, 20, 22, Cause.WORKER_LOST, 10.0),
        attempt(2, 20, 29, Cause.PREEMPTED, 20.0),
        attempt(3, 25, 40, None, 30.0),
    ])
    fired = [
        {"fault": "ctimeout@21:0", "kind": "ctimeout", "step": 21, "time": 4.0},
        {"fault": "kill@23:1", "kind": "kill", "step": 23, "time": 14.9},
        {"fault": "term@28", "kind": "term", "step": 28, "time": 24.0},
    ]
    assert [r.classified_as for r in records(sup, fired)] == [
        Cause.COLLECTIVE_TIMEOUT, Cause.WORKER_LOST, Cause.PREEMPTED]
