"""Replays of generated traces keep the promises of the policies, under every policy."""
from __future__ import annotations

import pytest

from traingate.capacity.jobs import Job
from traingate.capacity.pools import parse_config
from traingate.capacity.policy import Policy
from traingate.capacity.report import COMPARED
from traingate.capacity.simulate import TraceJob, simulate, summarize
from traingate.capacity.trace import TraceParams, generate

CFG = parse_config({
    "pools": {"p": {"gpus_per_node": 4, "nodes": 4, "price_per_gpu_hour": 2.0, "worker": "docker"}},
    "quotas": {"vision": {"p": 10}, "speech": {"p": 8}},
    "simulator": {"checkpoint_every_s": 600, "restart_cost_s": 60, "preempt_grace_s": 10},
})


@pytest.fixture(scope="module")
def trace():
    rows = generate(TraceParams(n_jobs=300, capacity=16, gpus_per_node=4, load=0.9, seed=7,
                                classes=(("urgent", 0.15), ("production", 0.3), ("research", 0.55)),
                                small_median_s=600, large_median_s=3 * 3600))
    return [TraceJob(Job(r["job_id"], r["team"], r["priority"], "p", r["gpus"], r["submit_s"],
                         checkpoint_every_s=600.0), r["duration_s"]) for r in rows]


def _intervals_of(r):
    """(record, start, end, nodes) of each attempt of a job."""
    for (start, nodes, how), end in zip(r.attempts, r.preempted_at + [r.end_s]):
        yield r, start, end, nodes


def _intervals(res):
    for r in res.records:
        yield from _intervals_of(r)


@pytest.mark.parametrize("name", COMPARED)
def test_every_job_finishes_and_no_node_quota_or_pool_is_ever_overcommitted(trace, name):
    res = simulate(trace, CFG, Policy.parse(name))
    assert len(res.records) == len(trace) and all(r.end_s is not None for r in res.records)
    events = sorted({t for _, s, e, _ in _intervals(res) for t in (s, e)})
    spans = list(_intervals(res))
    for t in events:
        per_node = [0] * 4
        per_team: dict[str, int] = {}
        for r, s, e, nodes in spans:
            if s <= t < e:
                for n in nodes:
                    per_node[n] += min(r.slots, 4)
                per_team[r.team] = per_team.get(r.team, 0) + r.footprint
        assert max(per_node) <= 4, (t, per_node)
        assert per_team.get("vision", 0) <= 10 and per_team.get("speech", 0) <= 8, (t, per_team)


@pytest.mark.parametrize("name", ["fifo+preempt", "fairshare+backfill+preempt"])
def test_a_preempted_job_loses_at_most_one_checkpoint_interval_per_preemption(trace, name):
    res = simulate(trace, CFG, Policy.parse(name))
    m = summarize(res)
    assert m.preemptions > 0
    # Held time = its work + at most (interval + resume + grace) per stop (a preemption, or a backfill
    # limit reached), and a preemptor's grace.
    for r in res.records:
        held = sum(e - s for _, s, e, _ in _intervals_of(r))
        starts_by_preemption = sum(1 for a in r.attempts if a[2] == "preemption")
        assert held >= r.duration_s - 1e-6
        assert held <= r.duration_s + len(r.preempted_at) * (600 + 60) + starts_by_preemption * 10 + 1e-6
    assert m.wait_by_class["urgent"] < summarize(simulate(trace, CFG, Policy.parse(name.replace("+preempt", "")))) \
        .wait_by_class["urgent"]


def test_without_preemption_every_job_runs_once_for_exactly_its_duration_unless_a_backfill_limit_stops_it(trace):
    res = simulate(trace, CFG, Policy.parse("fairshare+backfill"))
    for r in res.records:
        assert r.preemptions == 0
        if not r.limit_stops:
            assert len(r.attempts) == 1 and r.end_s - r.first_start_s == pytest.approx(r.duration_s)
        else:  # each stopped attempt was backfilled; the last one ran to the end
            assert r.limit_stops == r.preempted_at and len(r.attempts) == len(r.limit_stops) + 1
            assert all(a[2] == "backfill" for a in r.attempts[:-1])
    assert sum(len(r.limit_stops) for r in res.records) > 0
    assert summarize(simulate(trace, CFG, Policy.parse("fairshare"))).wasted_gpu_h == pytest.approx(0.0, abs=1e-9)


def test_the_replay_is_deterministic(trace):
    a = simulate(trace, CFG, Policy.parse("sjf+backfill+preempt"))
    b = simulate(trace, CFG, Policy.parse("sjf+backfill+preempt"))
    assert [(r.attempts, r.end_s) for r in a.records] == [(r.attempts, r.end_s) for r in b.records]


def test_backfill_cuts_the_mean_wait_of_strict_fair_share_on_a_gang_heavy_trace(trace):
    strict = summarize(simulate(trace, CFG, Policy.parse("fairshare")))
    easy = summarize(simulate(trace, CFG, Policy.parse("fairshare+backfill")))
    assert easy.mean_wait_s < strict.mean_wait_s


def test_under_the_default_a_research_job_past_the_starvation_bound_runs_before_a_stream_of_production_jobs():
    # One GPU; a 25 h research job holds it. r (research) waits behind it while a production job arrives
    # every hour. Past 24 h r goes first under the default; by class order alone it waits out the stream.
    cfg = parse_config({"pools": {"p": {"gpus_per_node": 1, "nodes": 1, "price_per_gpu_hour": 1.0,
                                        "worker": "process"}}})
    h = 3600.0
    trace = [TraceJob(Job("a", "t", "research", "p", 1, 0.0), 25 * h), TraceJob(Job("r", "t", "research", "p", 1, 1.0), h)]
    trace += [TraceJob(Job(f"p{i:02d}", "u", "production", "p", 1, i * h), h) for i in range(1, 31)]
    default = Policy.default(cfg.scheduling)
    assert default.name == "fairshare+aged+backfill+preempt"
    starts = {r.job_id: r.first_start_s for r in simulate(trace, cfg, default).records}
    assert starts["r"] == 25 * h and starts["p01"] == 26 * h
    alone = {r.job_id: r.first_start_s for r in simulate(trace, cfg, Policy.parse("fairshare+backfill+preempt")).records}
    assert alone["p01"] == 25 * h and alone["r"] == 55 * h


def test_a_preempted_job_is_predicted_anew_when_it_restarts():
    # b starts at 10 predicted 10 s (a's 10 s, its team's and size's only end). Urgent u preempts it at 20
    # (the cheapest victim). c, like b, ends at 210 after 200 s: b's prediction is now 105 s, and b, back
    # behind the production head h (the whole node, reserved past f's and g's ends), backfills at 210 on
    # it and is held to it: 210 + 60 (restart) + 105, not to its first attempt's 10 s.
    cfg = parse_config({
        "pools": {"p": {"gpus_per_node": 8, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}},
        "simulator": {"checkpoint_every_s": 600, "restart_cost_s": 60, "preempt_grace_s": 0},
    })
    trace = [
        TraceJob(Job("f", "w", "research", "p", 4, 0.0, est_duration_s=1e5), 1e5),
        TraceJob(Job("a", "t", "research", "p", 1, 0.0), 10.0),
        TraceJob(Job("b", "t", "research", "p", 1, 10.0), 5000.0),
        TraceJob(Job("c", "t", "research", "p", 1, 10.0), 200.0),
        TraceJob(Job("g", "z", "production", "p", 2, 10.0, est_duration_s=1e5), 1e5),
        TraceJob(Job("u", "x", "urgent", "p", 1, 20.0, est_duration_s=5000.0), 5000.0),
        TraceJob(Job("h", "y", "production", "p", 8, 25.0, est_duration_s=100.0), 100.0),
    ]
    b = {r.job_id: r for r in simulate(trace, cfg, Policy.parse("priority+backfill+preempt")).records}["b"]
    assert b.attempts[:2] == [(10.0, (0,), "in order"), (210.0, (0,), "backfill")]
    assert b.preempted_at[:2] == [20.0, 375.0] and b.limit_stops == [375.0]
