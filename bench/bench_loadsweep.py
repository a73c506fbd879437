"""The default policy against FIFO+backfill over offered loads 0.5-1.5 (`python -m bench loadsweep`).

Two traces on the 64-GPU gpu-a100 pool of examples/pools.yaml (its quotas and simulator costs), each
generated once and then load-scaled by compressing or stretching its arrivals
(traingate.capacity.load.at_load), SEEDS seeds each:

- ``shaped``: the generator's trace the simulator docs use (Alibaba PAI / Acme shapes: 3.2% gang jobs
  of 16 or 32 GPUs holding 94% of the GPU time, 65% recurring jobs, classes urgent/production/research);
- ``plain``: Poisson arrivals of 1-8 GPU jobs (1, 2, 4, 8 alike), lognormal durations (median 30 min),
  the same teams and classes, no gang jobs wider than a node.

At each load: mean and p95 wait of each policy, their ratios to fifo+backfill, utilisation, and per
class the mean and the worst wait (the starvation check). Policies: fifo+backfill (Slurm's default),
the pools config's default (fairshare + its backfill and preemption switches, +aged with its starvation
bound), the other preemption setting, so the preemption default is decided on the same sweep, and
the default without +aged (class order alone), so is the starvation bound, and hrrn+backfill+preempt,
the order with the lowest mean wait measured at about the default's utilisation, offered by name.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path

import numpy as np

from traingate.capacity.jobs import Job
from traingate.capacity.load import at_load, offered_load
from traingate.capacity.policy import Policy
from traingate.capacity.pools import load_config
from traingate.capacity.simulate import SimResult, TraceJob, simulate
from traingate.capacity.slurm_mode import planner_for
from traingate.capacity.trace import TraceParams, generate

ROOT = Path(__file__).resolve().parents[1]
N_JOBS = int(os.environ.get("TRAINGATE_BENCH_SWEEP_JOBS", "4000"))
SEEDS = int(os.environ.get("TRAINGATE_BENCH_SWEEP_SEEDS", "2"))
LOADS = tuple(float(x) for x in os.environ.get("TRAINGATE_BENCH_SWEEP_LOADS", "0.5,0.75,1.0,1.25,1.5").split(","))
POOL = "gpu-a100"
CLASSES = ("urgent", "production", "research")
EXTRA = [p for p in os.environ.get("TRAINGATE_BENCH_SWEEP_EXTRA", "").split(",") if p]


def _jobs(rows, config) -> list[TraceJob]:
    return [
        TraceJob(
            Job(
                str(r["job_id"]),
                str(r["team"]),
                str(r["priority"]),
                POOL,
                int(r["gpus"]),
                float(r["submit_s"]),
                checkpoint_every_s=config.simulator.checkpoint_every_s,
            ),
            float(r["duration_s"]),
        )
        for r in rows
    ]


def shaped(config, seed: int) -> list[TraceJob]:
    pool = config.pools[POOL]
    return _jobs(
        generate(
            TraceParams(n_jobs=N_JOBS, capacity=pool.capacity, gpus_per_node=pool.gpus_per_node, load=0.8, seed=seed)
        ),
        config,
    )


def plain(config, seed: int) -> list[TraceJob]:
    rng = np.random.default_rng(1000 + seed)
    teams = ["vision", "language", "speech", "recsys"]
    rows = []
    t = 0.0
    for k in range(N_JOBS):
        t += float(rng.exponential(600.0))
        rows.append(
            {
                "job_id": f"p{k:05d}",
                "submit_s": t,
                "duration_s": float(rng.lognormal(np.log(1800.0), 1.0)),
                "gpus": int(rng.choice([1, 2, 4, 8])),
                "team": teams[int(rng.choice(4, p=[0.4, 0.3, 0.2, 0.1]))],
                "priority": str(rng.choice(CLASSES, p=[0.05, 0.30, 0.65])),
            }
        )
    return _jobs(rows, config)


def _figures(res: SimResult) -> dict[str, float]:
    waits = np.array([r.wait_s for r in res.records])
    out = {
        "mean": float(waits.mean()),
        "p95": float(np.percentile(waits, 95)),
        "jct": float(np.mean([r.jct_s for r in res.records])),
    }
    busy = sum(p.window_busy_gpu_s for p in res.pools)
    cap = sum(p.capacity * p.window_s for p in res.pools)
    out["util"] = busy / cap if cap else 0.0
    for c in CLASSES:
        w = [r.wait_s for r in res.records if r.priority == c]
        out[f"{c}_mean"] = float(np.mean(w)) if w else 0.0
        out[f"{c}_max"] = float(np.max(w)) if w else 0.0
    return out


def main() -> str:
    config = load_config(ROOT / "examples" / "pools.yaml")
    default = Policy.default(config.scheduling)
    other = dataclasses.replace(default, preempt=not default.preempt)
    unaged = dataclasses.replace(default, aged=False)
    base = Policy.parse("fifo+backfill")
    hrrn = Policy.parse("hrrn+backfill+preempt")
    policies = [base, default, other] + ([unaged] if default.aged else []) + [hrrn] + [Policy.parse(p) for p in EXTRA]
    text = (
        f"{N_JOBS}-job traces, seeds 0-{SEEDS - 1}, on {POOL} ({config.pools[POOL].capacity} GPUs); "
        f"default = {default.name}; waits in hours, ratios to {base.name} (means over seeds)\n"
    )
    for name, make in (("shaped", shaped), ("plain", plain)):
        traces = [make(config, s) for s in range(SEEDS)]
        recorded = statistics.fmean(offered_load(t, config) for t in traces)
        text += (
            f"\n### {name} trace (offered load as generated: {recorded:.2f})\n\n"
            "| load | policy | mean wait | p95 wait | mean / fifo+bf | p95 / fifo+bf | mean JCT | utilisation | "
            + " | ".join(f"{c} mean / worst" for c in CLASSES)
            + " |\n"
            + "|---" * (8 + len(CLASSES))
            + "|\n"
        )
        for load in LOADS:
            scaled = [at_load(t, config, load) for t in traces]
            figs = {}
            for p in policies:
                runs = [_figures(simulate(t, config, p, planner=planner_for(p, config))) for t in scaled]
                figs[p.name] = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
            b = figs[base.name]
            for p in policies:
                f = figs[p.name]
                text += (
                    f"| {load:g} | {p.name}{' (default)' if p == default else ''} | {f['mean'] / 3600:.2f} | "
                    f"{f['p95'] / 3600:.2f} | {f['mean'] / b['mean'] if b['mean'] else 1:.2f} | "
                    f"{f['p95'] / b['p95'] if b['p95'] else 1:.2f} | {f['jct'] / 3600:.2f} | {f['util']:.1%} | "
                    + " | ".join(f"{f[c + '_mean'] / 3600:.2f} / {f[c + '_max'] / 3600:.1f}" for c in CLASSES)
                    + " |\n"
                )
            print(f"loadsweep: {name} at {load:g} done", flush=True)
    return text
