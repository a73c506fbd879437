"""Predictions come from the submitter or from finished jobs, never from the true duration."""
from __future__ import annotations

from traingate.capacity.estimate import HistoryEstimator, predicted_remaining
from traingate.capacity.jobs import Job, at_risk_s, requeued, started, work_s
from traingate.capacity.pools import parse_config
from traingate.capacity.policy import Policy
from traingate.capacity.simulate import TraceJob, simulate


def j(jid, team="a", slots=1, est=None):
    return Job(jid, team, "research", "p", slots, 0.0, est_duration_s=est)


def test_prediction_falls_back_from_team_and_size_to_size_to_everything_to_none():
    e = HistoryEstimator()
    assert e.predict(j("x")) is None
    e.observe(j("1", "a", 1), 100.0)
    e.observe(j("2", "b", 1), 200.0)
    e.observe(j("3", "b", 4), 900.0)
    assert e.predict(j("x", "a", 1)) == 100.0      # same team and size
    assert e.predict(j("x", "c", 1)) == 150.0      # same size
    assert e.predict(j("x", "c", 2)) == 400.0      # everything
    assert e.predict(j("x", "c", 2, est=42.0)) == 42.0   # the submitter's estimate wins


def test_remaining_work_of_a_resumed_job_subtracts_its_durable_progress():
    resumed = Job("r", "a", "research", "p", 1, 0.0, est_duration_s=100.0, done_s=70.0)
    assert predicted_remaining(resumed, lambda job: job.est_duration_s) == 30.0
    overdue = Job("r", "a", "research", "p", 1, 0.0, est_duration_s=100.0, done_s=120.0)
    assert predicted_remaining(overdue, lambda job: job.est_duration_s) == 0.0


def test_a_preempted_attempt_keeps_its_checkpointed_work_and_loses_the_rest():
    run = started(Job("r", "a", "research", "p", 1, 0.0, checkpoint_every_s=60.0, overhead_s=10.0), 100.0, (0,))
    assert work_s(run, 230.0) == 120.0 and at_risk_s(run, 230.0) == 0.0
    assert at_risk_s(run, 275.0) == 45.0
    back = requeued(run, 275.0, restart_cost_s=30.0)
    assert (back.done_s, back.overhead_s, back.attempt, back.started_s) == (120.0, 30.0, 1, None)


def test_a_backfilled_job_that_outruns_its_estimate_is_stopped_at_it_and_the_reserved_head_starts_on_time():
    # 1 node x 4 GPUs. 'a' holds 2 GPUs until 100. 'wide' (4 GPUs) waits, reserved at 100.
    # 'liar' claims 50 s and is backfilled at 10 (ends 60 <= 100 by its estimate) but needs 150 s:
    # held to its estimate as Slurm holds a job to its --time, it is stopped at 60 and 'wide' starts
    # at 100. With an honest estimate it is not backfilled.
    cfg = parse_config({"pools": {"p": {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 1, "worker": "process"}}})

    def trace(liar_est):
        return [TraceJob(Job("a", "t", "research", "p", 2, 0.0, est_duration_s=100.0), 100.0),
                TraceJob(Job("wide", "t", "research", "p", 4, 5.0, est_duration_s=10.0), 10.0),
                TraceJob(Job("liar", "t", "research", "p", 2, 10.0, est_duration_s=liar_est), 150.0)]

    recs = {r.job_id: r for r in simulate(trace(50.0), cfg, Policy.parse("fifo+backfill")).records}
    assert {k: r.first_start_s for k, r in recs.items()} == {"a": 0.0, "wide": 100.0, "liar": 10.0}
    assert recs["liar"].limit_stops == [60.0] and recs["liar"].attempts[1][0] == 110.0
    starts = {r.job_id: r.first_start_s for r in simulate(trace(150.0), cfg, Policy.parse("fifo+backfill")).records}
    assert starts == {"a": 0.0, "wide": 100.0, "liar": 110.0}
