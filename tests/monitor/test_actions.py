"""Alerts acting on real runs: the supervisor's monitor over a real torchrun tree (CPU, gloo).

A loss spike (weights blown up by an injected fault) is rolled back to the checkpoint before it and
the stage finishes with a finite loss; the same spike with ``action: pause`` stops at an emergency
checkpoint that `resume` continues; a run that crosses its budget mid-way is paused and resumes
once the budget is raised. The logbook and alerts.jsonl say what happened.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest

from traingate.job import files
from traingate.job.stagejob import derive
from traingate.job.vocab import Cause, Status
from traingate.ladder.outcomes import from_supervision, resumable_stop
from traingate.runtime.checkpoint import Checkpointer
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision.supervisor import Hooks, read_state, supervise

# 1 process, 0.1 s a step (the `slow` fault): long enough for the monitor (1 s cadence) to see the spike.
# The step-time rule is off: a step's own time (the fault's sleep is not in it) is about 5 ms of compute, whose
# median the box's load alone moves by more than the rule's 20%; these tests name every alert they expect.
SPEC = """
resources: {procs_per_node: 1}
stages: {full: {max_steps: 60}}
checkpoint: {every_steps: 10, keep_last: 10}
tracking: {enabled: false}
supervision: {backoff_base_s: 0.2, hang_timeout_s: 20, preempt_grace_s: 20}
alerts: {step_time_regression: {enabled: false}}
"""


# The injected spike blows the weights up, which also trips the gradient-norm rule, whose default action is a
# roll-back. It decides at the spike's own step, the loss-spike rule once the spike has lasted `steps` steps:
# which acts first depends on when the monitor's tick falls. Where the loss-spike rule's action is the subject,
# the gradient-norm rule only notifies.
ONLY_SPIKE_ACTS = "alerts.grad_norm_explosion.action=notify"


def _run(tiny_spec, tmp_path, faults: str, *overrides: str, name: str = "run", resumed=None, **job_changes):
    spec = load_spec(tiny_spec(SPEC, name=f"{name}.yaml"), list(overrides))
    job = derive(spec, "full", run_id=name, run_dir=tmp_path / name, settings=Settings.from_env(),
                 faults=faults or None)
    job = dataclasses.replace(job, **job_changes)
    events: list[tuple[str, dict]] = []
    log: list[str] = []
    sup = supervise(job, hooks=Hooks(info=log.append, on_alert=lambda n, e: events.append((n, e))), seed=0,
                    resumed=resumed)
    return sup, job, events, log


def _final_loss(stage_dir: Path) -> float:
    return files.read_metrics(stage_dir)[-1].loss


@pytest.mark.slow
def test_a_loss_spike_is_rolled_back_to_the_checkpoint_before_it_and_the_stage_finishes_finite(
        tiny_spec, state_dir, tmp_path):
    # 100 paced steps: the rollback lands long before the stage could end on its own, on a busy box too.
    sup, job, events, log = _run(tiny_spec, tmp_path, "slow@0,spike@33", "stages.full.max_steps=100", ONLY_SPIKE_ACTS)
    stage_dir = Path(job.stage_dir)

    assert sup.status == Status.COMPLETED, sup.error
    assert [a.cause for a in sup.attempts] == [Cause.ROLLBACK, None]
    rb = sup.job.rollbacks[0]
    assert (rb.rule, rb.at_step, rb.to_step, rb.skip) == ("loss-spike", 34, 30, 4)
    # The next launch resumed at the checkpoint before the spike, not at one written after it.
    assert sup.attempts[1].start_step == 30
    alerts = {a.rule: a for a in files.read_alerts(stage_dir)}
    # The blown-up weights trip the gradient-norm rule too (at the spike's step, before or with the loss-spike
    # rule's verdict): recorded, one action taken.
    assert set(alerts) == {"loss-spike", "grad-norm-explosion"}
    spike = alerts["loss-spike"]
    assert spike.outcome.startswith("rolling back to step 30") and "runbooks.md#loss-spike" in spike.message
    assert alerts["grad-norm-explosion"].outcome in ("notified",
                                                     "no further action: the stage is already being rolled back")
    kinds = [e.kind for e in files.read_logbook(Path(job.run_dir))]
    assert sorted(kinds) == ["alert", "alert", "rollback"] and kinds[-1] == "rollback"
    assert sorted(n for n, _ in events) == ["alert.grad-norm-explosion", "alert.loss-spike", "run.rolled_back"]
    # It went on past the spike: every step to the end, a finite loss back near where it was before.
    metrics = [m for m in files.read_metrics(stage_dir) if m.attempt == sup.attempts[1].number]
    assert metrics[0].step == 31 and metrics[-1].step == 100
    before = [m.loss for m in files.read_metrics(stage_dir) if m.attempt == 0 and 20 < m.step <= 30]
    assert math.isfinite(_final_loss(stage_dir)) and _final_loss(stage_dir) < 2 * max(before)
    assert Checkpointer(job.checkpoint_uri, async_save=False).list_steps()[-1] == 100


@pytest.mark.slow
def test_a_spike_with_action_pause_stops_at_an_emergency_checkpoint_and_resume_finishes(tiny_spec, state_dir,
                                                                                        tmp_path):
    # 200 paced steps (0.1 s each): the pause lands long before the stage could end on its own, on a busy box too.
    steps = "stages.full.max_steps=200"
    sup, job, _, _ = _run(tiny_spec, tmp_path, "slow@0,spike@33", "alerts.loss_spike.action=pause", steps,
                          ONLY_SPIKE_ACTS, name="paused")
    assert sup.status == Status.PREEMPTED, sup.error
    assert sup.error.startswith("paused by alert loss-spike") and "traingate resume paused" in sup.error
    assert sup.paused_by == "alert loss-spike"  # the ladder's final state says so, not "preempted"
    assert resumable_stop("full", from_supervision(job, sup, 1.0), "paused").startswith("full paused by alert loss-spike")
    ck = Checkpointer(job.checkpoint_uri, async_save=False)
    stopped_at = ck.list_steps()[-1]
    assert 34 < stopped_at < 200  # an emergency checkpoint where it stopped, past the spike
    assert [a.action for a in files.read_alerts(Path(job.stage_dir)) if a.rule == "loss-spike"] == ["pause"]

    # The resume runs unpaced: only where it starts is the subject.
    again, _, _, _ = _run(tiny_spec, tmp_path, "", "alerts.loss_spike.enabled=false", steps, name="paused",
                          resumed=read_state(Path(job.stage_dir)))
    assert again.status == Status.COMPLETED, again.error
    assert again.attempts[0].start_step == stopped_at


@pytest.mark.slow
def test_a_run_crossing_its_budget_mid_stage_is_paused_and_resumes_when_the_budget_is_raised(
        tiny_spec, state_dir, tmp_path):
    # $100 a slot-hour on one slot: about 2.8 cents a second, 200 steps of 0.1 s; earlier stages already
    # spent $0.05 of the $0.35: the stage crosses the budget about 11 s after its launch.
    price = "pools.cpu-local.price_per_gpu_hour=100"
    steps = "stages.full.max_steps=200"
    sup, job, events, _ = _run(tiny_spec, tmp_path, "slow@0", price, steps, name="budget",
                               budget_usd=0.35, spent_before_usd=0.05)
    assert sup.status == Status.PREEMPTED and sup.error.startswith("paused by alert budget-exhausted"), sup.error
    assert sup.paused_by == "alert budget-exhausted"
    rules = [a.rule for a in files.read_alerts(Path(job.stage_dir))]
    assert rules == ["budget-warning", "budget-exhausted"]
    paused_at = Checkpointer(job.checkpoint_uri, async_save=False).list_steps()[-1]
    assert 0 < paused_at < 200
    exhausted = [e for n, e in events if n == "alert.budget-exhausted"][0]
    assert exhausted["values"]["budget_usd"] == 0.35 and exhausted["values"]["spent_usd"] >= 0.35

    again, _, _, _ = _run(tiny_spec, tmp_path, "slow@0", price, steps, name="budget", budget_usd=10.0,
                          spent_before_usd=0.35, resumed=read_state(Path(job.stage_dir)))
    assert again.status == Status.COMPLETED, again.error
    assert again.attempts[-1].start_step == paused_at


@pytest.mark.slow
def test_a_spike_with_action_stop_ends_the_stage_failed_with_cause_alert_and_posts_the_webhook(
        tiny_spec, state_dir, tmp_path, monkeypatch):
    from test_notify import _server

    server, posted = _server()
    monkeypatch.setenv("TG_HOOK", f"http://127.0.0.1:{server.server_port}/hook/s3cret")
    monkeypatch.setenv("TRAINGATE_ENV_ALLOW", "TG_HOOK")
    # 100 paced steps (0.1 s each): the rule's stop lands well before the stage could end on its own, on a busy box too.
    sup, job, _, _ = _run(tiny_spec, tmp_path, "slow@0,spike@13", "alerts.loss_spike.action=stop", ONLY_SPIKE_ACTS,
                          "stages.full.max_steps=100", 'alerts.webhook_url="${env:TG_HOOK}"', name="stopped")
    assert (sup.status, sup.cause) == (Status.FAILED, Cause.ALERT)
    assert sup.error.startswith("stopped by alert loss-spike: loss-spike: train_loss")
    assert [a.outcome for a in files.read_alerts(Path(job.stage_dir)) if a.rule == "loss-spike"] == ["stopped for good"]
    # The gradient-norm rule's notification may be posted before or after the loss-spike rule's stop.
    def spike_posts() -> list[dict]:
        return [p["body"] for p in posted if p["body"].get("rule") == "loss-spike"]

    deadline = time.monotonic() + 10
    while not spike_posts() and time.monotonic() < deadline:
        time.sleep(0.1)
    server.shutdown()
    assert [(b["run_id"], b["outcome"]) for b in spike_posts()] == [("stopped", "stopped for good")]
    assert "s3cret" not in (Path(job.stage_dir) / "job.json").read_text()  # the reference, not the URL


@pytest.mark.slow
def test_a_straggler_rank_quarantines_its_host_and_pauses_the_stage(tiny_spec, state_dir, tmp_path):
    # Rank 1 sleeps 0.1 s before every step: its own work is far slower than rank 0's.
    sup, job, _, _ = _run(tiny_spec, tmp_path, "slow@0:1", "resources.procs_per_node=2",
                          "alerts.straggler.window=20", "stages.full.max_steps=200", name="straggler")
    assert sup.status == Status.PREEMPTED and sup.error.startswith("paused by alert straggler"), sup.error
    alert = files.read_alerts(Path(job.stage_dir))[0]
    assert alert.rule == "straggler" and alert.values["rank"] == 1 and "quarantined" in alert.outcome
    quarantined = files.read_json(Path(job.run_dir) / "quarantine.json")
    assert quarantined[0]["rank"] == 1 and quarantined[0]["rule"] == "straggler"
