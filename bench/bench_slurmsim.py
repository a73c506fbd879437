"""Slurm mode against Slurm (`python -m bench slurmsim`): one time-compressed slice of short `sleep` jobs replayed
on the real Slurm 22.05 test cluster (tests/slurm/cluster.py: 2 nodes x 2 fake a100 GPUs, priority/multifactor
with QOS 100000 / fair share 10000 / age 100 weights, a one-hour usage half-life, PriorityCalcPeriod 1 min,
sched/backfill; started here and torn down at the end; needs root and the Debian Slurm packages) and in the
simulator, whose ``multifactor+backfill`` order reads the same weights.

The slice (seeded): N_JOBS jobs over about SPAN_S seconds of Poisson arrivals, 1 GPU (60%), 2 GPUs on one node
(30%) or 2 nodes x 2 GPUs (10%); `sleep` of 1-6 s; accounts vision and language; QOS research (70%) or
production (30%); every job `--time=1` (one minute, Slurm's smallest limit: what backfill plans with).
Slurm records each job's submission, start and end (sacct, whole seconds; written to
<state dir>/bench/slurmsim-jobs.csv, which TRAINGATE_BENCH_SLURMSIM_FROM=that file compares again without Slurm).
The simulator replays the same jobs: submitted when Slurm recorded them, running as long as they ran there
(end - start), predicted to run their one-minute limit. Slurm frees a job's GPUs only after its epilog and the
controller's completion, and starts the next job at its next scheduling pass: the *release gap*, measured here as
the median, over jobs that waited, of their start minus the last end at or before it. The simulator runs each job
as recorded and, when the gap is not 0, once more holding its GPUs that gap longer. Reported: the rank correlation of the start order
(Spearman over start times; ties share a rank), the rank correlation of the waits, and the ratio of the mean
waits (simulator / Slurm), for the Slurm mode and, beside it, the simulator's fifo+backfill and fairshare+backfill.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy
from traingate.capacity.pools import parse_config
from traingate.capacity.simulate import TraceJob, simulate
from traingate.capacity.slurm_mode import planner_for

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test cluster is the tests' own

from slurm.cluster import SlurmCluster, missing_binaries  # noqa: E402

N_JOBS = int(os.environ.get("TRAINGATE_BENCH_SLURMSIM_JOBS", "120"))
SPAN_S = float(os.environ.get("TRAINGATE_BENCH_SLURMSIM_SPAN_S", "220"))
SEED = int(os.environ.get("TRAINGATE_BENCH_SLURMSIM_SEED", "0"))
POOL = "slurm-gpu"
# The test cluster's QOS priorities (research 10, production 100, urgent 1000) and slurm.conf's weights.
CONFIG = {
    "pools": {POOL: {"gpus_per_node": 2, "nodes": 2, "price_per_gpu_hour": 1.0, "worker": "process"}},
    "priority_classes": {"urgent": {"priority": 1000, "preempts": True}, "production": {"priority": 100},
                         "research": {"priority": 10}},
    "scheduling": {"half_life_h": 1.0},
    "simulator": {"slurm_priority": {"weight_qos": 100000, "weight_fairshare": 10000, "weight_age": 100,
                                     "max_age_h": 168, "calc_period_s": 60}},
}
POLICIES = ("multifactor+backfill", "fifo+backfill", "fairshare+backfill")
FROM = os.environ.get("TRAINGATE_BENCH_SLURMSIM_FROM")
COLUMNS = ("name", "account", "qos", "gpus", "submit", "start", "end")


def slice_jobs(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    t = 0.0
    jobs = []
    for k in range(N_JOBS):
        jobs.append({"name": f"s{k:03d}", "at": t, "sleep": int(rng.integers(1, 7)),
                     "gpus": int(rng.choice([1, 2, 4], p=[0.6, 0.3, 0.1])),
                     "account": str(rng.choice(["vision", "language"])),
                     "qos": str(rng.choice(["research", "production"], p=[0.7, 0.3]))})
        t += float(rng.exponential(SPAN_S / N_JOBS))
    return jobs


def _sbatch_args(j: dict) -> list[str]:
    shape = ["--nodes=2", "--gres=gpu:a100:2"] if j["gpus"] == 4 else ["--nodes=1", f"--gres=gpu:a100:{j['gpus']}"]
    return ["sbatch", "--parsable", "--job-name", j["name"], f"--account={j['account']}", f"--qos={j['qos']}",
            "--time=1", "--output=/dev/null", *shape, "--wrap", f"sleep {j['sleep']}"]


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def run_on_slurm(cluster: SlurmCluster, jobs: list[dict]) -> dict[str, tuple[float, float, float]]:
    """Submit each job at its time; wait for all; (submit, start, end) per job name from sacct."""
    env = {**os.environ, **cluster.env}
    ids: dict[str, str] = {}
    errors: list[str] = []
    t0 = time.monotonic() + 1.0

    def submit() -> None:
        for j in jobs:
            delay = t0 + j["at"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            r = subprocess.run(_sbatch_args(j), capture_output=True, text=True, env=env)
            if r.returncode:
                errors.append(f"{j['name']}: {r.stderr.strip()}")
            else:
                ids[j["name"]] = r.stdout.strip().split(";")[0]

    th = threading.Thread(target=submit)
    th.start()
    th.join()
    if errors:
        raise RuntimeError(f"sbatch refused {len(errors)} jobs, first: {errors[0]}")
    deadline = time.monotonic() + 900
    while subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env).stdout.strip():
        if time.monotonic() > deadline:
            raise RuntimeError("jobs still queued or running after 15 minutes")
        time.sleep(1.0)
    want = ",".join(ids.values())
    for _ in range(60):
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", want, "--format=JobName,Submit,Start,End,State"],
                             capture_output=True, text=True, env=env).stdout
        rows = [line.split("|") for line in out.strip().splitlines()]
        done = {r[0]: r for r in rows if r[4] == "COMPLETED"}
        if len(done) == len(ids):
            return {n: (_epoch(r[1]), _epoch(r[2]), _epoch(r[3])) for n, r in done.items()}
        time.sleep(1.0)
    raise RuntimeError(f"sacct shows {len(done)} of {len(ids)} jobs completed")


def _trace(jobs: list[dict], slurm: dict[str, tuple[float, float, float]], gap_s: float) -> list[TraceJob]:
    t0 = min(s for s, _, _ in slurm.values())
    return [TraceJob(Job(j["name"], j["account"], j["qos"], POOL, j["gpus"], slurm[j["name"]][0] - t0,
                         est_duration_s=60.0),
                     max(slurm[j["name"]][2] - slurm[j["name"]][1], 1.0) + gap_s) for j in jobs]


def release_gap(slurm: dict[str, tuple[float, float, float]]) -> float:
    """Median over the jobs that waited of (their start - the last end at or before it)."""
    ends = sorted(e for _, _, e in slurm.values())
    gaps = []
    for sub, start, _ in slurm.values():
        before = [e for e in ends if e <= start]
        if start - sub > 1.0 and before:
            gaps.append(start - before[-1])
    return float(np.median(gaps)) if gaps else 0.0


def _save(path: Path, jobs: list[dict], slurm: dict[str, tuple[float, float, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [",".join(COLUMNS)] + [",".join(str(v) for v in (j["name"], j["account"], j["qos"], j["gpus"],
                                                                *slurm[j["name"]])) for j in jobs]
    path.write_text("\n".join(lines) + "\n")


def _load(path: Path) -> tuple[list[dict], dict[str, tuple[float, float, float]]]:
    rows = [dict(zip(COLUMNS, line.split(","))) for line in path.read_text().splitlines()[1:]]
    jobs = [{"name": r["name"], "account": r["account"], "qos": r["qos"], "gpus": int(r["gpus"])} for r in rows]
    return jobs, {r["name"]: (float(r["submit"]), float(r["start"]), float(r["end"])) for r in rows}


def main() -> str:
    t_run = time.monotonic()
    if FROM:
        jobs, slurm = _load(Path(FROM))
    else:
        missing = missing_binaries()
        if missing or os.geteuid() != 0:
            return f"slurmsim: skipped ({missing[0] + ' is not installed' if missing else 'needs root'})\n"
        jobs = slice_jobs(SEED)
        base = Path(tempfile.mkdtemp(prefix="traingate-slurmsim-"))
        try:
            with SlurmCluster.start(base) as cluster:
                slurm = run_on_slurm(cluster, jobs)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        _save(Path(os.environ.get("TRAINGATE_STATE_DIR", ".traingate")) / "bench" / "slurmsim-jobs.csv", jobs, slurm)
    t_run = time.monotonic() - t_run
    config = parse_config(CONFIG)
    gap = release_gap(slurm)
    trace = _trace(jobs, slurm, 0.0)
    t0 = min(s for s, _, _ in slurm.values())
    names = [j["name"] for j in jobs]
    s_start = np.array([slurm[n][1] - t0 for n in names])
    s_wait = np.array([slurm[n][1] - slurm[n][0] for n in names])
    gpu_s = sum(tj.job.slots * tj.duration_s for tj in trace)
    span = max(tj.job.submit_s for tj in trace)
    text = (f"{N_JOBS} jobs (seed {SEED}) over {span:.0f} s, {gpu_s:.0f} GPU-s held on 4 GPUs "
            f"(offered load {gpu_s / 4 / span:.2f}); on Slurm: makespan {max(slurm[n][2] for n in names) - t0:.0f} s, "
            f"mean wait {s_wait.mean():.1f} s, p95 {np.percentile(s_wait, 95):.1f} s (whole bench {t_run:.0f} s)\n\n"
            f"release gap (median start - last end before it, over jobs that waited): {gap:.0f} s\n\n"
            "| simulator policy | GPUs held | start-order rank correlation | wait rank correlation | mean wait (s) | "
            "mean wait / Slurm's | p95 wait (s) |\n|---|---|---|---|---|---|---|\n")
    for name in POLICIES:
        variants = [("as recorded", trace)] + ([(f"+ {gap:.0f} s release gap", _trace(jobs, slurm, gap))] if gap else [])
        for held, tr in variants:
            p = Policy.parse(name)
            res = simulate(tr, config, p, planner=planner_for(p, config))
            by = {r.job_id: r for r in res.records}
            start = np.array([by[n].first_start_s for n in names])
            wait = np.array([by[n].wait_s for n in names])
            text += (f"| {name}{' (Slurm mode)' if p.order.value == 'multifactor' else ''} | {held} | "
                     f"{spearmanr(s_start, start).statistic:.3f} | {spearmanr(s_wait, wait).statistic:.3f} | "
                     f"{wait.mean():.1f} | {wait.mean() / s_wait.mean():.2f} | {np.percentile(wait, 95):.1f} |\n")
    return text
