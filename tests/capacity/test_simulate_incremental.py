"""The simulator's incremental pass makes the decisions of ``policy.schedule``, the straightforward
pass that rebuilds everything from lists; and a backfilled job is held to its prediction."""

from __future__ import annotations

import pytest

from traingate.capacity.incremental import straightforward_pass
from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy
from traingate.capacity.pools import parse_config
from traingate.capacity.report import COMPARED
from traingate.capacity.simulate import TraceJob, simulate
from traingate.capacity.trace import TraceParams, generate


def _config(gpn: int, nodes: int):
    return parse_config(
        {
            "pools": {"p": {"gpus_per_node": gpn, "nodes": nodes, "price_per_gpu_hour": 2.0, "worker": "docker"}},
            "quotas": {"vision": {"p": gpn * nodes * 5 // 8}, "speech": {"p": gpn * nodes // 2}},
            "simulator": {"checkpoint_every_s": 600, "restart_cost_s": 60, "preempt_grace_s": 10},
        }
    )


def _trace(gpn: int, nodes: int, n: int, seed: int, estimates: bool):
    rows = generate(
        TraceParams(
            n_jobs=n,
            capacity=gpn * nodes,
            gpus_per_node=gpn,
            load=0.95,
            seed=seed,
            classes=(("urgent", 0.15), ("production", 0.3), ("research", 0.55)),
            small_median_s=600,
            large_median_s=3 * 3600,
        )
    )
    return [
        TraceJob(
            Job(
                r["job_id"],
                r["team"],
                r["priority"],
                "p",
                r["gpus"],
                r["submit_s"],
                est_duration_s=(r["duration_s"] * (0.5 + (k % 4) / 2) if estimates and k % 3 else None),
                checkpoint_every_s=600.0,
            ),
            r["duration_s"],
        )
        for k, r in enumerate(rows)
    ]


def _schedule_of(res):
    return [(r.job_id, r.attempts, r.preempted_at, r.limit_stops, r.end_s) for r in res.records]


@pytest.mark.parametrize("name", COMPARED)
@pytest.mark.parametrize(("gpn", "nodes", "estimates"), [(4, 4, False), (8, 6, True)])
def test_the_incremental_pass_replays_every_attempt_as_the_straightforward_schedule_does(name, gpn, nodes, estimates):
    cfg = _config(gpn, nodes)
    trace = _trace(gpn, nodes, 300, seed=nodes, estimates=estimates)
    fast = simulate(trace, cfg, Policy.parse(name))
    slow = simulate(trace, cfg, Policy.parse(name), planner=straightforward_pass)
    assert _schedule_of(fast) == _schedule_of(slow)
    assert [(p.busy_gpu_s, p.fragmented_gpu_s, p.team_gpu_s) for p in fast.pools] == [
        (p.busy_gpu_s, p.fragmented_gpu_s, p.team_gpu_s) for p in slow.pools
    ]


def test_a_backfilled_job_that_outruns_its_estimate_is_stopped_at_it_and_the_head_starts_at_its_reservation():
    cfg = parse_config(
        {
            "pools": {"p": {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}},
            "simulator": {"checkpoint_every_s": 600, "restart_cost_s": 120, "preempt_grace_s": 30},
        }
    )
    trace = [
        TraceJob(Job("running", "t", "research", "p", 2, 0.0, est_duration_s=100.0), 100.0),
        TraceJob(Job("head", "t", "research", "p", 4, 1.0, est_duration_s=100.0), 100.0),  # reserved for 100
        TraceJob(Job("under", "t", "research", "p", 2, 2.0, est_duration_s=50.0), 500.0),  # says 50, needs 500
    ]
    res = {r.job_id: r for r in simulate(trace, cfg, Policy.parse("fifo+backfill")).records}
    under = res["under"]
    assert under.attempts[0] == (2.0, (0,), "backfill")
    assert under.limit_stops == under.preempted_at == [52.0] and under.preemptions == 0
    assert res["head"].first_start_s == 100.0  # not 502: the overrun cannot push it back
    # Back in the queue with its estimate discredited, it runs after the head, paying the restart.
    assert under.attempts[1] == (200.0, (0,), "in order") and under.end_s == 200.0 + 120.0 + 500.0
