"""The replay on shared GPUs (traingate.capacity.shared): fractions packed, best fit against FGD,
and the same jobs with each fraction rounded up to one whole GPU as the baseline.

Traces are generated (traingate.capacity.trace.generate, seed 0, JOBS jobs at offered load LOAD,
counting each fraction as asked) with bench_fill's three mixes of small jobs: halves and quarters,
tenths, and fractions only (0.3, 0.4, 0.6, 0.7); the first two beside 1-8 whole GPUs and gang jobs
of a quarter and half of the pool. Each is replayed under fifo+backfill on a pool of NODES nodes x 8
GPUs: rounded (every fraction a whole GPU, no shared GPUs), bestfit and fgd. Reported: mean and p95
wait, utilisation while jobs arrive (GPU time held, fractions as asked), fragmented GPUs (time
average of free capacity no job size of the trace can use; on the rounded replay, free GPUs stranded
from the head job), jobs replayed per CPU-second. TRAINGATE_BENCH_SHARED_JOBS / _NODES / _LOAD
change the size.
"""

from __future__ import annotations

import dataclasses
import os

from bench.bench_fill import MIXES, WHOLE
from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy
from traingate.capacity.pools import Placement, parse_config
from traingate.capacity.simulate import TraceJob, simulate, summarize
from traingate.capacity.trace import TraceParams, generate

JOBS = int(os.environ.get("TRAINGATE_BENCH_SHARED_JOBS", "10000"))
NODES = int(os.environ.get("TRAINGATE_BENCH_SHARED_NODES", "16"))
LOAD = float(os.environ.get("TRAINGATE_BENCH_SHARED_LOAD", "0.9"))
POLICY = "fifo+backfill"


def _trace(fractions: tuple[tuple[float, float], ...], only: bool) -> list[TraceJob]:
    rows = generate(
        TraceParams(
            n_jobs=JOBS,
            capacity=NODES * 8,
            gpus_per_node=8,
            load=LOAD,
            seed=0,
            small_sizes=fractions if only else fractions + WHOLE,
            large_fraction=0.0 if only else 0.032,
        )
    )
    out = []
    for r in rows:
        g = r["gpus"]
        share = round(g * 1000) if g < 1 else 0
        job = Job(r["job_id"], r["team"], r["priority"], "p", max(1, int(g)), r["submit_s"], milli=share)
        out.append(TraceJob(job, r["duration_s"], (), g if share else None))
    return out


def main() -> str:
    base = parse_config(
        {"pools": {"p": {"gpus_per_node": 8, "nodes": NODES, "price_per_gpu_hour": 1.0, "worker": "docker"}}}
    )
    lines = [
        f"| fractions | replay | mean wait (h) | p95 wait (h) | mean wait / rounded | utilisation "
        f"| fragmented GPUs | jobs per CPU-s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mix, fractions in MIXES.items():
        trace = _trace(fractions, mix.endswith("only"))
        rounded = [dataclasses.replace(tj, job=dataclasses.replace(tj.job, milli=0), gpus=None) for tj in trace]
        runs = [("rounded up to 1 GPU", rounded, base)]
        for p in Placement:
            cfg = base.model_copy(update={"simulator": base.simulator.model_copy(update={"placement": p})})
            runs.append((f"shared, {p}", trace, cfg))
        ref = None
        for name, tr, cfg in runs:
            res = simulate(tr, cfg, Policy.parse(POLICY))
            m = summarize(res)
            ref = ref if ref is not None else m.mean_wait_s
            lines.append(
                f"| {mix} | {name} | {m.mean_wait_s / 3600:.2f} | {m.p95_wait_s / 3600:.2f} "
                f"| {m.mean_wait_s / ref if ref else float('nan'):.2f} | {m.utilisation:.1%} "
                f"| {m.fragmented_gpus:.2f} | {len(tr) / res.cpu_s:,.0f} |"
            )
            print(lines[-1], flush=True)
    return (
        "\n".join(lines)
        + f"\n\n({JOBS:,} jobs at offered load {LOAD} on {NODES} nodes x 8 GPUs, {POLICY}; "
        + f"1-minute load average at the end: {os.getloadavg()[0]:.1f})\n"
    )
