"""A discrete-event replay of a job trace through :func:`traingate.capacity.policy.schedule`.

No Prefect, no processes, no clocks: time jumps from event to event (a submission, a job's
end). At each event time the simulator finishes what ended, enqueues what arrived, asks the
policy for a plan and carries it out exactly as the orchestrator would: preempted jobs lose
their work since their last checkpoint and go back to the queue, to pay ``restart_cost_s``
when they resume; a preemptor pays the victims' ``preempt_grace_s``. The true durations stay
here; the policy sees predictions only (:mod:`traingate.capacity.estimate`), a running job's fixed
when it starts. A backfilled attempt is held to its predicted end, as Slurm holds a job to its time
limit: unfinished there, it is stopped like a victim (a limit stop) and not predicted again, so it
cannot delay the head it jumped. Pools are independent, so each is replayed on its own and fair
share counts usage per pool. Each pass is :func:`traingate.capacity.incremental.plan_pass`, the
decisions of ``schedule`` over state kept from pass to pass.

>>> from traingate.capacity.pools import parse_config
>>> cfg = parse_config({"pools": {"p": {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 1.0,
...                                     "worker": "process"}}})
>>> trace = [TraceJob(Job("a", "t", "research", "p", 4, 0.0), 100.0),
...          TraceJob(Job("b", "t", "research", "p", 2, 10.0), 50.0)]
>>> res = simulate(trace, cfg, Policy.parse("fifo"))
>>> [(r.job_id, r.first_start_s, r.end_s) for r in res.records]
[('a', 0.0, 100.0), ('b', 100.0, 150.0)]
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from traingate.capacity.estimate import HistoryEstimator
from traingate.capacity.fairshare import advance
from traingate.capacity.gang import footprint
from traingate.capacity.incremental import Queue, Running, plan_pass
from traingate.capacity.jobs import Job, requeued
from traingate.capacity.policy import How, Plan, Policy, Rules, never_fits
from traingate.capacity.pools import CapacityConfig, CapacityError, PoolConfig


@dataclass(frozen=True)
class TraceJob:
    job: Job
    duration_s: float  # true work; only the simulator knows it


@dataclass
class JobRecord:
    job_id: str
    team: str
    priority: str
    pool: str
    slots: int
    footprint: int
    submit_s: float
    duration_s: float
    first_start_s: float | None = None
    end_s: float | None = None
    attempts: list[tuple[float, tuple[int, ...], str]] = field(default_factory=list)  # (start, nodes, how)
    preempted_at: list[float] = field(default_factory=list)  # attempt k ended here, the last one at end_s
    # Those of preempted_at where a backfilled attempt reached its predicted end (its limit) unfinished.
    limit_stops: list[float] = field(default_factory=list)

    @property
    def preemptions(self) -> int:
        return len(self.preempted_at) - len(self.limit_stops)

    @property
    def wait_s(self) -> float:
        assert self.first_start_s is not None
        return self.first_start_s - self.submit_s

    @property
    def jct_s(self) -> float:
        assert self.end_s is not None
        return self.end_s - self.submit_s


@dataclass
class PoolTotals:
    pool: str
    capacity: int
    price_per_gpu_hour: float
    makespan_s: float = 0.0  # first submission to last end
    busy_gpu_s: float = 0.0  # GPUs held x time (restarts and lost work included)
    # Utilisation and fragmentation are measured while work keeps arriving (first to last
    # submission; the whole replay when everything arrives at once): the drain at the end,
    # when the queue empties whatever the policy, would only dilute them.
    window_s: float = 0.0
    window_busy_gpu_s: float = 0.0
    fragmented_gpu_s: float = 0.0  # see gang.fragmented
    team_gpu_s: dict[str, float] = field(default_factory=dict)


@dataclass
class SimResult:
    policy: Policy
    half_life_h: float
    records: list[JobRecord]
    pools: list[PoolTotals]
    wall_s: float
    cpu_s: float  # the replay's own CPU time: its speed on a machine shared with other work


def simulate(
    trace: Sequence[TraceJob],
    config: CapacityConfig,
    policy: Policy,
    half_life_h: float | None = None,
    planner: Planner | None = None,
) -> SimResult:
    """Replay ``trace`` under ``policy``. ``half_life_h`` overrides the config's fair-share half-life;
    ``planner`` one pass (``incremental.plan_pass``'s signature; tests pass one over ``policy.schedule``)."""
    for tj in trace:
        why = never_fits(tj.job, config.pools, config.priority_classes, config.quotas)
        if why:
            raise CapacityError(f"job {tj.job.job_id}: {why}")
    h = config.scheduling.half_life_h if half_life_h is None else half_life_h
    t0, c0 = time.perf_counter(), time.process_time()
    records: list[JobRecord] = []
    totals: list[PoolTotals] = []
    for name in sorted({tj.job.pool for tj in trace}):
        rec, tot = _replay_pool(
            name,
            config.pools[name],
            [tj for tj in trace if tj.job.pool == name],
            config,
            Rules(policy, config.priority_classes, config.quotas_on(name), config.simulator.restart_cost_s),
            h * 3600.0,
            planner or plan_pass,
        )
        records += rec
        totals.append(tot)
    records.sort(key=lambda r: (r.submit_s, r.job_id))
    return SimResult(policy, h, records, totals, time.perf_counter() - t0, time.process_time() - c0)


Planner = Callable[..., tuple[Plan, list[Job]]]  # plan_pass's signature


def _replay_pool(
    name: str,
    pool: PoolConfig,
    trace: list[TraceJob],
    config: CapacityConfig,
    rules: Rules,
    half_life_s: float,
    planner: Planner = plan_pass,
) -> tuple[list[JobRecord], PoolTotals]:
    gpn = pool.gpus_per_node
    sim = config.simulator
    arrivals = sorted(trace, key=lambda tj: (tj.job.submit_s, tj.job.job_id))
    true = {tj.job.job_id: tj.duration_s for tj in trace}
    rec = {
        tj.job.job_id: JobRecord(
            tj.job.job_id,
            tj.job.team,
            tj.job.priority,
            name,
            tj.job.slots,
            footprint(tj.job.slots, gpn),
            tj.job.submit_s,
            tj.duration_s,
        )
        for tj in trace
    }
    tot = PoolTotals(name, pool.capacity, pool.price_per_gpu_hour)
    waiting = Queue()
    run = Running(pool.nodes, gpn)
    running = run.jobs
    held = run.held  # team -> GPUs held now
    # (end, job id, attempt, why): why 0 = its work is done, 1 = its backfill limit; stale after a stop
    ends: list[tuple[float, str, int, int]] = []
    usage: dict[str, float] = {}  # team -> decayed GPU-hours
    estimator = HistoryEstimator()
    # A running job's prediction is fixed when it starts, as a Slurm job's end is by its time limit;
    # a job that ran into its backfill limit has shown its prediction wrong and is not predicted again.
    fixed: dict[str, float | None] = {}
    overran: set[str] = set()

    def predict(job: Job) -> float | None:
        if job.job_id in overran:
            return None
        if job.started_s is not None and job.job_id in fixed:
            return fixed[job.job_id]
        return estimator.predict(job)

    i, n = 0, len(arrivals)
    t = arrivals[0].job.submit_s if arrivals else 0.0
    start_t = t
    window_end = arrivals[-1].job.submit_s if arrivals else 0.0
    stranded = 0

    while i < n or running or len(waiting):
        while ends and (ends[0][1] not in running or running[ends[0][1]].attempt != ends[0][2]):
            heapq.heappop(ends)
        nt = min(arrivals[i].job.submit_s if i < n else math.inf, ends[0][0] if ends else math.inf)
        assert nt < math.inf, f"pool {name}: jobs wait with nothing running and nothing to come: {sorted(waiting.byid)}"
        dt = nt - t
        if dt > 0:
            busy = pool.capacity - run.free.total
            tot.busy_gpu_s += busy * dt
            in_window = max(0.0, min(nt, window_end) - t) if window_end > start_t else dt
            tot.window_busy_gpu_s += busy * in_window
            tot.fragmented_gpu_s += stranded * in_window
            for team, g in held.items():
                tot.team_gpu_s[team] = tot.team_gpu_s.get(team, 0.0) + g * dt
            usage = advance(usage, held, dt, half_life_s)
            t = nt
        while ends and ends[0][0] <= t:
            _, jid, attempt, why = heapq.heappop(ends)
            job = running.get(jid)
            if job is None or job.attempt != attempt:
                continue
            if why:
                # Held to its limit: stopped at its checkpoint like a victim, back in the queue.
                run.remove(jid)
                fixed.pop(jid, None)
                overran.add(jid)
                waiting.add(requeued(job, t, sim.restart_cost_s), discredited=True)
                rec[jid].preempted_at.append(t)
                rec[jid].limit_stops.append(t)
                continue
            run.remove(jid)
            fixed.pop(jid, None)
            rec[jid].end_s = t
            estimator.observe(job, true[jid])
        while i < n and arrivals[i].job.submit_s <= t:
            waiting.add(arrivals[i].job)
            i += 1
        while True:
            plan, victims = planner(t, pool, run, waiting, rules, usage, predict)
            for v in victims:
                rec[v.job_id].preempted_at.append(t)
                waiting.add(requeued(v, t, sim.restart_cost_s), discredited=v.job_id in overran)
            for s in plan.starts:
                job = running[s.job_id]
                fixed[job.job_id] = pred = predict(job)
                if s.how is How.PREEMPTION and sim.preempt_grace_s:
                    run.remove(job.job_id)
                    job = dataclasses.replace(job, overhead_s=job.overhead_s + sim.preempt_grace_s)
                    run.add(job, pred)
                finish = t + job.overhead_s + true[job.job_id] - job.done_s
                why = 0
                if s.how is How.BACKFILL:
                    # Backfilled on its prediction, held to it: it may not delay the head it jumped.
                    assert pred is not None, f"{job.job_id}: backfilled without a prediction"
                    limit = t + job.overhead_s + max(pred - job.done_s, 0.0)
                    if finish > limit:
                        finish, why = limit, 1
                heapq.heappush(ends, (finish, job.job_id, job.attempt, why))
                r = rec[job.job_id]
                if r.first_start_s is None:
                    r.first_start_s = t
                r.attempts.append((t, s.nodes, s.how.value))
            # Slots freed by a preemption may let a job the pass already passed over start.
            if not plan.preempted:
                break
        head = waiting.byid.get(plan.head) if plan.head else None
        stranded = run.free.fragmented(head.slots if head else None)
    tot.makespan_s = t - start_t
    tot.window_s = window_end - start_t if window_end > start_t else tot.makespan_s
    return list(rec.values()), tot


@dataclass(frozen=True)
class Metrics:
    jobs: int
    mean_wait_s: float
    p95_wait_s: float
    mean_jct_s: float
    p95_jct_s: float
    utilisation: float  # GPU-time held / (capacity x time), while jobs arrive (PoolTotals.window_s)
    fragmented_gpus: float  # time-averaged free GPUs stranded from the head job (gang.fragmented), summed over pools
    fragmented_frac: float  # ... as a fraction of capacity
    preemptions: int
    wasted_gpu_h: float  # held but not useful: restart costs, grace, work lost to preemption
    cost_usd: float  # GPU-hours held x pool price
    wait_by_class: dict[str, float]
    wait_by_team: dict[str, float]
    share_by_team: dict[str, float]  # fraction of GPU-hours held


def summarize(res: SimResult) -> Metrics:
    recs = res.records
    assert all(r.end_s is not None for r in recs), "a replay ends when every job has finished"
    waits = np.array([r.wait_s for r in recs]) if recs else np.zeros(1)
    jcts = np.array([r.jct_s for r in recs]) if recs else np.zeros(1)
    busy = sum(p.busy_gpu_s for p in res.pools)
    cap_time = sum(p.capacity * p.window_s for p in res.pools)
    useful = sum(r.footprint * r.duration_s for r in recs)
    team_gpu: dict[str, float] = {}
    for p in res.pools:
        for team, g in p.team_gpu_s.items():
            team_gpu[team] = team_gpu.get(team, 0.0) + g

    def mean_by(attr: str) -> dict[str, float]:
        groups: dict[str, list[float]] = {}
        for r in recs:
            groups.setdefault(getattr(r, attr), []).append(r.wait_s)
        return {k: float(np.mean(v)) for k, v in sorted(groups.items())}

    frag = sum(p.fragmented_gpu_s / p.window_s for p in res.pools if p.window_s > 0)
    return Metrics(
        jobs=len(recs),
        mean_wait_s=float(waits.mean()),
        p95_wait_s=float(np.percentile(waits, 95)),
        mean_jct_s=float(jcts.mean()),
        p95_jct_s=float(np.percentile(jcts, 95)),
        utilisation=sum(p.window_busy_gpu_s for p in res.pools) / cap_time if cap_time else 0.0,
        fragmented_gpus=frag,
        fragmented_frac=frag / sum(p.capacity for p in res.pools) if res.pools else 0.0,
        preemptions=sum(r.preemptions for r in recs),
        wasted_gpu_h=max(0.0, busy - useful) / 3600.0,  # max: float dust when nothing was wasted
        cost_usd=sum(p.busy_gpu_s / 3600.0 * p.price_per_gpu_hour for p in res.pools),
        wait_by_class=mean_by("priority"),
        wait_by_team=mean_by("team"),
        share_by_team={t: g / busy for t, g in sorted(team_gpu.items())} if busy else {},
    )
