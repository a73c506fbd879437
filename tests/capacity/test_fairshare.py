"""The fair-share formula with hand numbers, and what it does to the queue."""
from __future__ import annotations

import math

import pytest

from traingate.capacity.fairshare import advance, decayed_usage
from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy, queue_order
from traingate.capacity.pools import _default_classes, parse_config
from traingate.capacity.simulate import TraceJob, simulate

H = 3600.0


def test_eight_gpus_for_one_half_life_weigh_eight_times_half_over_ln2_gpu_hours():
    # integral over [0, H] of 8 * 2^(-(H - s)/H) ds = 8 * H/ln2 * (1 - 1/2) seconds = 8 * 0.5/ln2 GPU-hours
    u = decayed_usage([("a", 8, 0.0, H)], now=H, half_life_s=H)["a"]
    assert u == pytest.approx(8 * 0.5 / math.log(2))          # 5.7708
    assert u == pytest.approx(5.770780, abs=1e-6)


def test_usage_halves_after_each_half_life_without_new_work():
    u0 = decayed_usage([("a", 8, 0.0, H)], now=H, half_life_s=H)["a"]
    assert decayed_usage([("a", 8, 0.0, H)], now=2 * H, half_life_s=H)["a"] == pytest.approx(u0 / 2)
    assert decayed_usage([("a", 8, 0.0, H)], now=4 * H, half_life_s=H)["a"] == pytest.approx(u0 / 8)


def test_a_short_interval_counts_almost_its_raw_gpu_hours():
    # 4 GPUs for 36 s with a 1-hour half-life: ~0.04 GPU-hours, decayed by at most 2^(-0.01)
    u = decayed_usage([("a", 4, 0.0, 36.0)], now=36.0, half_life_s=H)["a"]
    assert 0.04 * 2 ** -0.01 < u < 0.04


def test_the_incremental_update_equals_the_closed_form_over_the_same_history():
    history = [("a", 4, 0.0, 1000.0), ("b", 2, 500.0, 4000.0), ("a", 8, 2000.0, 5000.0)]
    events = sorted({0.0, 500.0, 1000.0, 2000.0, 4000.0, 5000.0, 7000.0})
    usage: dict[str, float] = {}
    for t0, t1 in zip(events, events[1:]):
        held: dict[str, int] = {}
        for team, g, a, b in history:
            if a <= t0 and t1 <= b:
                held[team] = held.get(team, 0) + g
        usage = advance(usage, held, t1 - t0, 1800.0)
    closed = decayed_usage(history, now=7000.0, half_life_s=1800.0)
    assert usage == pytest.approx(closed)


def test_within_a_class_the_team_with_fewer_gpu_hours_goes_first_but_a_higher_class_still_wins():
    jobs = [Job("b1", "b", "research", "p", 1, 0.0), Job("a1", "a", "research", "p", 1, 5.0),
            Job("b2", "b", "production", "p", 1, 9.0)]
    order = queue_order(jobs, Policy.parse("fairshare"), _default_classes(), {"b": 3.0, "a": 0.5}, lambda j: None)
    assert [j.job_id for j in order] == ["b2", "a1", "b1"]


def test_one_training_job_of_team_a_is_not_stuck_behind_forty_sweep_trials_of_team_b():
    cfg = parse_config({"pools": {"p": {"gpus_per_node": 8, "nodes": 1, "price_per_gpu_hour": 1, "worker": "process"}},
                        "scheduling": {"half_life_h": 6}})
    trace = [TraceJob(Job(f"trial{k:02d}", "b", "research", "p", 1, 0.0, est_duration_s=100.0), 100.0)
             for k in range(40)]
    trace.append(TraceJob(Job("train", "a", "research", "p", 4, 1.0, est_duration_s=100.0), 100.0))
    start = {p: {r.job_id: r.first_start_s for r in simulate(trace, cfg, Policy.parse(p)).records}["train"]
             for p in ("fifo", "fairshare")}
    assert start["fifo"] == 500.0        # after all 40 trials, 8 at a time
    assert start["fairshare"] == 100.0   # as soon as the first wave of trials frees the node
