"""Simulator speed at cluster scale: jobs replayed per CPU-second, by trace size and cluster size.

Generated traces (traingate.capacity.trace.generate) on pools of 8, 100, 800 and 1,600 nodes x 8 GPUs,
10k, 100k and 1M jobs, in two regimes: no queue (load 0.3: nearly every job starts on arrival)
and contention (load 0.95 under fifo+backfill, fairshare+backfill+preempt and the default
fairshare+aged+backfill+preempt, whose starvation bound is the config's 24 h: a sixth to four
fifths of the jobs wait). Large (gang) jobs are a quarter and half of the pool up to
16 and 32 nodes. Besides the speed, the replay's own work: passes per job, and the jobs and the
groups (``incremental.Queue``: jobs the policy decides alike) waiting at a pass, averaged over the
passes; a pass looks at groups, not jobs. They are counted by a wrapper around each pass, inside the
timed replay (about 3% of its time). The baseline is the same replay with each pass done by
``policy.schedule`` over lists rebuilt every pass (``incremental.straightforward_pass``), on the
10k-job traces only (it is quadratic). TRAINGATE_BENCH_SIMSPEED_MAX_JOBS caps the sizes (default
1,000,000; the 1M-job rows take about two thirds of the bench's 6-8 minutes).
"""

from __future__ import annotations

import os
from typing import Any

from traingate.capacity.incremental import plan_pass, straightforward_pass
from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy
from traingate.capacity.pools import parse_config
from traingate.capacity.simulate import TraceJob, simulate
from traingate.capacity.trace import TraceParams, generate

MAX_JOBS = int(os.environ.get("TRAINGATE_BENCH_SIMSPEED_MAX_JOBS", "1000000"))
REGIMES = (
    ("no queue", 0.3, "fifo+backfill"),
    ("contention", 0.95, "fifo+backfill"),
    ("contention", 0.95, "fairshare+backfill+preempt"),
    ("contention", 0.95, "fairshare+aged+backfill+preempt"),
)
# By trace size on 800 nodes, then by cluster size at 100k jobs.
CELLS = [(800, 10_000), (800, 100_000), (800, 1_000_000), (8, 100_000), (100, 100_000), (1600, 100_000)]


def _case(nodes: int, n: int, load: float):
    cfg = parse_config(
        {
            "pools": {"p": {"gpus_per_node": 8, "nodes": nodes, "price_per_gpu_hour": 1.0, "worker": "docker"}},
            "simulator": {"checkpoint_every_s": 1800, "restart_cost_s": 120, "preempt_grace_s": 30},
        }
    )
    sizes = ((max(1, min(nodes // 4, 16)) * 8, 0.6), (max(1, min(nodes // 2, 32)) * 8, 0.4))
    rows = generate(TraceParams(n_jobs=n, capacity=nodes * 8, gpus_per_node=8, load=load, seed=0, large_sizes=sizes))
    trace = [
        TraceJob(
            Job(r["job_id"], r["team"], r["priority"], "p", r["gpus"], r["submit_s"], checkpoint_every_s=1800.0),
            r["duration_s"],
        )
        for r in rows
    ]
    return cfg, trace


class _Counted:
    """``plan_pass`` counting the passes and the jobs and groups waiting at each."""

    def __init__(self) -> None:
        self.passes = self.jobs = self.groups = 0

    def __call__(self, now, pool, run, queue, rules, usage, predict) -> Any:
        self.passes += 1
        self.jobs += len(queue.byid)
        self.groups += len(queue._live)
        return plan_pass(now, pool, run, queue, rules, usage, predict)


def main() -> str:
    lines = [
        "| nodes x 8 GPUs | jobs | regime | policy | waited | passes per job | jobs waiting per pass "
        "| groups waiting per pass | jobs per CPU-s | CPU-us per pass | straightforward pass | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    made: tuple = ()
    for nodes, n in CELLS:
        if n > MAX_JOBS:
            continue
        for regime, load, pol in REGIMES:
            if made[:3] != (nodes, n, load):
                made = ()  # one trace of a million jobs held at a time
                made = (nodes, n, load, *_case(nodes, n, load))
            cfg, trace = made[3], made[4]
            counted = _Counted()
            res = simulate(trace, cfg, Policy.parse(pol), planner=counted)
            speed = n / res.cpu_s
            waited = sum(r.wait_s > 0 for r in res.records) / n
            base = ratio = "-"
            if n <= 10_000:
                ref = simulate(trace, cfg, Policy.parse(pol), planner=straightforward_pass)
                assert [r.attempts for r in ref.records] == [r.attempts for r in res.records], "passes disagree"
                base, ratio = f"{n / ref.cpu_s:,.0f}", f"{ref.cpu_s / res.cpu_s:.1f}x"
            p = counted.passes
            lines.append(
                f"| {nodes:,} | {n:,} | {regime} (load {load}) | {pol} | {waited:.0%} | {p / n:.2f} "
                f"| {counted.jobs / p:,.0f} | {counted.groups / p:.1f} | {speed:,.0f} "
                f"| {res.cpu_s / p * 1e6:.1f} | {base} | {ratio} |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines) + f"\n\n(1-minute load average at the end: {os.getloadavg()[0]:.1f})\n"
