"""Slurm mode: the multifactor order (QOS, fair-share and age factors times their weights) and the
usage it sees, refreshed every PriorityCalcPeriod; hand-worked."""

from __future__ import annotations

import pytest

from capacity.test_simulate_incremental import _config, _schedule_of, _trace
from traingate.capacity.incremental import straightforward_pass
from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy, queue_order
from traingate.capacity.pools import SlurmPriorityConfig, _default_classes, parse_config
from traingate.capacity.simulate import TraceJob, simulate
from traingate.capacity.slurm_mode import SlurmModePlanner, planner_for

CLASSES = _default_classes()  # urgent 100, production 50, research 10


def job(job_id: str, team: str, cls: str, submit_s: float = 0.0) -> Job:
    return Job(job_id, team, cls, "p", 1, submit_s)


def test_multifactor_lets_an_unused_teams_research_job_pass_a_heavy_teams_production_job_when_the_weights_say_so():
    waiting = [job("prod-a", "a", "production"), job("res-b", "b", "research"), job("res-a", "a", "research")]
    usage = {"a": 5.0, "b": 1.0}  # fair-share factors: b 2/2 = 1, a 1/2 (b uses less)
    # QOS 10000 x (0.5 | 0.1) + fair share 10000 x (0.5 | 1): prod-a 10000, res-b 11000, res-a 6000.
    even = SlurmPriorityConfig(weight_qos=10000, weight_fairshare=10000, weight_age=0)
    order = queue_order(waiting, Policy.parse("multifactor"), CLASSES, usage, lambda j: None, 0.0, even)
    assert [j.job_id for j in order] == ["res-b", "prod-a", "res-a"]
    # The test cluster's weights (QOS 100000 over fair share 10000): class first, then fair share.
    order = queue_order(
        waiting, Policy.parse("multifactor"), CLASSES, usage, lambda j: None, 0.0, SlurmPriorityConfig()
    )
    assert [j.job_id for j in order] == ["prod-a", "res-b", "res-a"]


def test_multifactor_age_lifts_an_old_job_over_a_younger_one_of_a_higher_class():
    w = SlurmPriorityConfig(weight_qos=10000, weight_fairshare=0, weight_age=10000, max_age_h=1)
    old = job("old-research", "a", "research", submit_s=0.0)  # 1000 + 10000 x 1 (an hour old, the cap)
    young = job("new-production", "a", "production", submit_s=3000.0)  # 5000 + 10000 x 600/3600 = 6667
    order = queue_order([young, old], Policy.parse("multifactor"), CLASSES, {}, lambda j: None, 3600.0, w)
    assert [j.job_id for j in order] == ["old-research", "new-production"]
    no_age = SlurmPriorityConfig(weight_qos=10000, weight_fairshare=0, weight_age=0)
    order = queue_order([old, young], Policy.parse("multifactor"), CLASSES, {}, lambda j: None, 3600.0, no_age)
    assert [j.job_id for j in order] == ["new-production", "old-research"]


def _cfg(calc_period_s: float):
    return parse_config(
        {
            "pools": {"p": {"gpus_per_node": 1, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}},
            "simulator": {"slurm_priority": {"calc_period_s": calc_period_s}},
        }
    )


@pytest.mark.parametrize(("period", "first"), [(0.0, "a1"), (1000.0, "b1")])
def test_slurm_mode_orders_by_the_fair_share_usage_of_the_last_priority_recomputation(period, first):
    # One GPU. b0 (team b) runs 0-50 s; b1 (b) arrives at 5 s, a1 (a) at 10 s. At 50 s team b has used
    # the GPU and a has not: with usage of the moment a1 goes first. With a 1000 s PriorityCalcPeriod
    # the last recomputation was at 0 s, when nobody had used anything: the older b1 goes first.
    trace = [
        TraceJob(job("b0", "b", "research"), 50.0),
        TraceJob(job("b1", "b", "research", 5.0), 10.0),
        TraceJob(job("a1", "a", "research", 10.0), 10.0),
    ]
    cfg = _cfg(period)
    res = simulate(trace, cfg, Policy.parse("multifactor"))  # Slurm mode with the config's weights by default
    starts = {r.job_id: r.first_start_s for r in res.records}
    assert starts[first] == 50.0 and sorted(starts.values()) == [0.0, 50.0, 60.0]


@pytest.mark.parametrize("name", ["multifactor+backfill", "multifactor+backfill+preempt"])
def test_slurm_mode_replays_every_attempt_as_the_straightforward_schedule_does(name):
    cfg = _config(4, 4)
    trace = _trace(4, 4, 300, seed=4, estimates=True)
    policy = Policy.parse(name)
    fast = simulate(trace, cfg, policy, planner=SlurmModePlanner(cfg.simulator.slurm_priority))
    slow = simulate(trace, cfg, policy, planner=SlurmModePlanner(cfg.simulator.slurm_priority, straightforward_pass))
    assert _schedule_of(fast) == _schedule_of(slow)


def test_slurm_mode_backfills_a_job_only_if_it_ends_a_backfill_resolution_before_the_heads_reservation():
    # Two GPUs. a holds one until 100 s (its estimate, and true). At 1 s the head h needs both: reserved
    # at 100 s. w (1 GPU, behind h in submission order) says 99 s: it would end at 100 s, exactly at the
    # reservation. The simulator's own backfill lets it in; Slurm, planning on a 60 s grid
    # (bf_resolution), counts it as overlapping.
    cfg = parse_config(
        {"pools": {"p": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}}}
    )
    trace = [
        TraceJob(Job("a", "t", "research", "p", 1, 0.0, est_duration_s=100.0), 100.0),
        TraceJob(Job("h", "t", "research", "p", 2, 1.0, est_duration_s=10.0), 10.0),
        TraceJob(Job("w", "t", "research", "p", 1, 1.0, est_duration_s=99.0), 5.0),
    ]
    own = simulate(trace, cfg, Policy.parse("fairshare+backfill"))
    assert {r.job_id: r.first_start_s for r in own.records} == {"a": 0.0, "h": 100.0, "w": 1.0}
    policy = Policy.parse("multifactor+backfill")
    slurm = simulate(trace, cfg, policy, planner=planner_for(policy, cfg))
    assert {r.job_id: r.first_start_s for r in slurm.records} == {"a": 0.0, "h": 100.0, "w": 110.0}
    no_grid = cfg.model_copy(
        update={
            "simulator": cfg.simulator.model_copy(update={"slurm_priority": SlurmPriorityConfig(bf_resolution_s=0)})
        }
    )
    loose = simulate(trace, no_grid, policy, planner=planner_for(policy, no_grid))
    assert {r.job_id: r.first_start_s for r in loose.records}["w"] == 1.0
