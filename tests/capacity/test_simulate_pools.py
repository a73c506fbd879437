"""Jobs that accept several pools: placed on whichever can start them first, counted where they ran,
and the incremental pass still makes the decisions of ``policy.schedule``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from traingate.capacity.figures import ALL, figures
from traingate.capacity.incremental import straightforward_pass
from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy
from traingate.capacity.pools import CapacityError, load_config, parse_config
from traingate.capacity.report import COMPARED, report
from traingate.capacity.simulate import TraceJob, simulate
from traingate.capacity.trace import TraceParams, generate, read_trace

POOL = {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}
AB = parse_config({"pools": {"a": POOL, "b": POOL, "c": POOL}, "simulator": {"checkpoint_every_s": 600}})


def job(jid, pools, gpus, submit, duration):
    return TraceJob(Job(jid, "t", "research", pools[0], gpus, submit, checkpoint_every_s=600.0), duration, pools)


def test_a_job_that_accepts_two_pools_starts_in_the_one_with_room_and_counts_there():
    # x holds a 0-100. y (a or b) starts in b at 1; z (a or b) waits and takes b when y ends at 51,
    # before a frees at 100. w is c's alone: c is replayed on its own.
    trace = [
        job("x", ("a",), 4, 0.0, 100.0),
        job("y", ("a", "b"), 4, 1.0, 50.0),
        job("z", ("a", "b"), 4, 2.0, 10.0),
        job("w", ("c",), 2, 0.0, 5.0),
    ]
    res = simulate(trace, AB, Policy.parse("fifo"))
    got = {r.job_id: (r.pool, r.first_start_s, r.end_s) for r in res.records}
    assert got == {"x": ("a", 0.0, 100.0), "y": ("b", 1.0, 51.0), "z": ("b", 51.0, 61.0), "w": ("c", 0.0, 5.0)}
    figs = {f.scope: f for f in figures(res)}
    assert (figs["a"].jobs, figs["b"].jobs, figs["c"].jobs, figs[ALL].jobs) == (1, 2, 1, 4)
    assert figs["b"].waits.mean_s == pytest.approx((0.0 + 49.0) / 2)
    busy = {p.pool: p.busy_gpu_s for p in res.pools}
    assert busy == {"a": 400.0, "b": 4 * 60.0, "c": 10.0}


def test_a_job_listing_a_pool_it_cannot_fit_is_refused_naming_the_pool():
    small = parse_config({"pools": {"a": POOL, "big": {**POOL, "nodes": 4}}})
    with pytest.raises(CapacityError, match=r"job y: 8 GPUs .*do not fit pool 'a'"):
        simulate([job("y", ("big", "a"), 8, 0.0, 1.0)], small, Policy.parse("fifo"))


def _two_pool_trace(n: int, seed: int):
    rows = generate(TraceParams(n_jobs=n, capacity=16, gpus_per_node=4, load=2.4, seed=seed, small_median_s=600))
    out = []
    for k, r in enumerate(rows):
        pools = (("a", "b"), ("b", "a"), ("a",), ("b",))[k % 4]
        j = Job(r["job_id"], r["team"], r["priority"], pools[0], r["gpus"], r["submit_s"], checkpoint_every_s=600.0)
        if k % 5 == 0:
            j = dataclasses.replace(j, est_duration_s=r["duration_s"] * (0.5 + (k % 3) / 2))
        out.append(TraceJob(j, r["duration_s"], pools))
    return out


@pytest.mark.parametrize("name", COMPARED)
def test_with_jobs_that_accept_several_pools_the_incremental_pass_replays_every_attempt_as_schedule_does(name):
    pool = {"gpus_per_node": 4, "nodes": 4, "price_per_gpu_hour": 1.0, "worker": "docker"}
    cfg = parse_config(
        {
            "pools": {"a": pool, "b": pool},
            "quotas": {"vision": {"a": 16, "b": 12}, "speech": {"a": 8}},
            "simulator": {"checkpoint_every_s": 600, "restart_cost_s": 60, "preempt_grace_s": 10},
        }
    )
    trace = _two_pool_trace(240, seed=2)
    fast = simulate(trace, cfg, Policy.parse(name))
    slow = simulate(trace, cfg, Policy.parse(name), planner=straightforward_pass)
    schedule = [(r.job_id, r.pool, r.attempts, r.preempted_at, r.limit_stops, r.end_s) for r in fast.records]
    assert schedule == [(r.job_id, r.pool, r.attempts, r.preempted_at, r.limit_stops, r.end_s) for r in slow.records]
    assert [(p.busy_gpu_s, p.team_gpu_s) for p in fast.pools] == [(p.busy_gpu_s, p.team_gpu_s) for p in slow.pools]
    ran = {r.pool for r in fast.records if r.job_id in {tj.job.job_id for tj in trace if len(tj.pools) > 1}}
    assert ran == {"a", "b"}  # jobs that accept both ran on both


def test_a_gpu_types_trace_is_tabled_per_pool_where_each_job_ran_and_in_total(tmp_path):
    # examples/pools.yaml: gpu-a100 (8 x 8 A100-80GB), gpu-h100 (4 x 8 H100-80GB). Under fifo the
    # 64-GPU d heads gpu-a100's queue from 3 s (a and b hold 16 of its GPUs until 100 s), so e, which
    # takes either GPU, starts on gpu-h100 at once; b starts on gpu-a100, the first pool by name.
    path = tmp_path / "t.csv"
    path.write_text(
        "job_id,submit_s,duration_s,gpus,gpu_types\n"
        "a,0,100,8,A100-80GB\nb,1,50,8,A100-80GB|H100-80GB\nc,2,10,16,H100-80GB\n"
        "d,3,10,64,A100-80GB\ne,4,10,4,A100-80GB|H100-80GB\n"
    )
    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "pools.yaml")
    res = simulate(read_trace(path, cfg), cfg, Policy.parse("fifo"))
    ran = {r.job_id: (r.pool, r.first_start_s) for r in res.records}
    assert ran == {"a": ("gpu-a100", 0.0), "b": ("gpu-a100", 1.0), "c": ("gpu-h100", 2.0),
                   "d": ("gpu-a100", 100.0), "e": ("gpu-h100", 4.0)}
    table = report([res], "t", None, [figures(res)])
    assert "| fifo | gpu-a100 | 3 | 64 |" in table and "| fifo | gpu-h100 | 2 | 32 |" in table
    assert "| fifo | all | 5 | 96 |" in table
