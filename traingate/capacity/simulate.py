"""A discrete-event replay of a job trace through :func:`traingate.capacity.policy.schedule`.

No Prefect, no processes, no clocks: time jumps from event to event (a submission, a job's
end). At each event time the simulator finishes what ended, enqueues what arrived, asks the
policy for a plan and carries it out exactly as the orchestrator would: preempted jobs lose
their work since their last checkpoint and go back to the queue, to pay ``restart_cost_s``
when they resume; a preemptor pays the victims' ``preempt_grace_s``. The true durations stay
here; the policy sees predictions only (:mod:`traingate.capacity.estimate`), a running job's fixed
when it starts. A backfilled attempt is held to its predicted end, as Slurm holds a job to its time
limit: unfinished there, it is stopped like a victim (a limit stop) and not predicted again, so it
cannot delay the head it jumped. A job may accept several pools (``TraceJob.pools``): it waits in
each and starts in the first whose pass can start it (pools in name order at each event), then
belongs to that pool. Pools no such job links are replayed on their own, linked pools together;
fair share counts usage per pool. Each pass is :func:`traingate.capacity.incremental.plan_pass`, the
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
import gc
import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from traingate.capacity.estimate import HistoryEstimator
from traingate.capacity.fairshare import advance_in_place, decay_step
from traingate.capacity.fill import MILLI, Workload
from traingate.capacity.gang import footprint
from traingate.capacity.incremental import Queue, Running, plan_pass
from traingate.capacity.jobs import Job, requeued
from traingate.capacity.policy import How, Order, Plan, Policy, Rules, never_fits
from traingate.capacity.pools import CapacityConfig, CapacityError, PoolConfig
from traingate.capacity.shared import SharedRunning
from traingate.capacity.slurm_mode import planner_for


@dataclass(frozen=True)
class TraceJob:
    job: Job
    duration_s: float  # true work; only the simulator knows it
    # Every pool the job accepts, ``job.pool`` first; () means ``job.pool`` only. It waits in each
    # and starts in whichever can start it first (pools passed in name order at each event), like a
    # Slurm job submitted to several partitions; once started it belongs to that pool: a requeued
    # attempt resumes there and its figures count there.
    pools: tuple[str, ...] = ()
    # A request below one GPU as the trace wrote it (e.g. 0.5; ``job.milli`` holds it in thousandths):
    # the replay and the fill experiment pack it onto a shared GPU. None: whole GPUs (``job.slots``).
    gpus: float | None = None

    @property
    def accepts(self) -> tuple[str, ...]:
        return self.pools or (self.job.pool,)


@dataclass
class JobRecord:
    job_id: str
    team: str
    priority: str
    pool: str
    slots: float  # GPUs asked: a fraction below one GPU as asked (thousandths)
    footprint: float  # GPUs held while it runs: a fraction as asked, whole nodes for a job wider than one
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
    # see gang.fragmented; on a pool with shared GPUs, SharedFreeIndex.fragmented (fill's measure)
    fragmented_gpu_s: float = 0.0
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
    ``planner`` one pass (``incremental.plan_pass``'s signature; tests pass one over ``policy.schedule``;
    default: ``plan_pass``, in Slurm mode for the ``multifactor`` order, see ``slurm_mode.planner_for``)."""
    if any(tj.job.milli for tj in trace):
        if policy.preempt:
            raise CapacityError(
                f"policy {policy.name}: the trace asks fractions of a GPU, and a preemption frees whole GPUs; "
                f"the replay does not preempt on shared GPUs: drop +preempt or round the fractions up to 1"
            )
        assert planner is None, "jobs on shared GPUs are planned by plan_pass only"
    # never_fits reads a job's pool, class, team and size only: asked once per distinct request.
    fine: set[tuple[str, str, str, int, tuple[str, ...]]] = set()
    for tj in trace:
        j = tj.job
        k = (j.pool, j.priority, j.team, j.slots, tj.pools)
        if k in fine:
            continue
        why = never_fits(j, config.pools, config.priority_classes, config.quotas)
        for name in tj.pools[1:]:
            why = why or never_fits(
                dataclasses.replace(j, pool=name), config.pools, config.priority_classes, config.quotas
            )
        if why:
            raise CapacityError(f"job {j.job_id}: {why}")
        fine.add(k)
    h = config.scheduling.half_life_h if half_life_h is None else half_life_h
    t0, c0 = time.perf_counter(), time.process_time()
    records: list[JobRecord] = []
    totals: list[PoolTotals] = []
    # A replay allocates every job's record and attempts and keeps them to its end, and makes no cycles:
    # the collector's passes over that growing heap find nothing (and cost about a tenth of building
    # 100k records).
    collecting = gc.isenabled()
    gc.disable()
    try:
        for names in _linked_pools(trace):
            rec, tots = _replay_pools(
                names,
                [tj for tj in trace if tj.job.pool in names],
                config,
                {n: Rules.of(policy, config, n) for n in names},
                h * 3600.0,
                planner or planner_for(policy, config) or plan_pass,
            )
            records += rec
            totals += tots
    finally:
        if collecting:
            gc.enable()
    records.sort(key=lambda r: (r.submit_s, r.job_id))
    totals.sort(key=lambda p: p.pool)
    return SimResult(policy, h, records, totals, time.perf_counter() - t0, time.process_time() - c0)


Planner = Callable[..., tuple[Plan, list[Job]]]  # plan_pass's signature


def _linked_pools(trace: Sequence[TraceJob]) -> list[list[str]]:
    """The pools with jobs, in groups linked by jobs that accept several (sorted): pools no job
    links are replayed on their own, linked pools together."""
    parent = {tj.job.pool: tj.job.pool for tj in trace}

    def root(p: str) -> str:
        while parent.setdefault(p, p) != p:
            p = parent[p]
        return p

    for tj in trace:
        if len(tj.pools) > 1:
            first = root(tj.pools[0])
            for other in tj.pools[1:]:
                parent[root(other)] = first
    groups: dict[str, list[str]] = {}
    for p in sorted(parent):
        groups.setdefault(root(p), []).append(p)
    return sorted(groups.values())


def _running(name: str, trace: Sequence[TraceJob], config: CapacityConfig) -> Running:
    """The running jobs of pool ``name``: on shared GPUs (placed by ``simulator.placement``) when a job
    that accepts it asks a fraction of a GPU, the fragmentation measured against the sizes asked there."""
    pool = config.pools[name]
    if not any(tj.job.milli for tj in trace if name in tj.accepts):
        return Running(pool.nodes, pool.gpus_per_node)
    asks = [tj.gpus if tj.gpus is not None else tj.job.slots for tj in trace if name in tj.accepts]
    return SharedRunning(pool.nodes, pool.gpus_per_node, Workload.of(asks), config.simulator.placement)


@dataclass
class _PoolState:
    """One pool of a replay: its running jobs, queue, fair-share usage, totals and window."""

    name: str
    pool: PoolConfig
    rules: Rules
    tot: PoolTotals
    run: Running
    waiting: Queue = field(default_factory=lambda: Queue(reported=True))  # told whose predictions move
    # team -> decayed GPU-hours (fairshare.advance_in_place at each event), kept when ``fair``: its order
    # ranks teams by it
    usage: dict[str, float] = field(default_factory=dict)
    fair: bool = False
    stranded: float = 0.0
    start_t: float = 0.0  # first and last submission of the jobs that accept it
    window_end: float = 0.0
    last_t: float = 0.0  # its last job's end


def _replay_pools(
    names: list[str],
    trace: list[TraceJob],
    config: CapacityConfig,
    rules: dict[str, Rules],
    half_life_s: float,
    planner: Planner = plan_pass,
) -> tuple[list[JobRecord], list[PoolTotals]]:
    sim = config.simulator
    arrivals = sorted(trace, key=lambda tj: (tj.job.submit_s, tj.job.job_id))
    states = {
        n: _PoolState(
            n,
            config.pools[n],
            rules[n],
            PoolTotals(n, config.pools[n].capacity, config.pools[n].price_per_gpu_hour),
            _running(n, trace, config),
        )
        for n in names
    }
    order = [states[n] for n in names]
    for st in order:
        subs = [tj.job.submit_s for tj in arrivals if st.name in tj.accepts] if len(order) > 1 else []
        st.start_t, st.window_end = (
            (subs[0], subs[-1])
            if subs
            else (arrivals[0].job.submit_s, arrivals[-1].job.submit_s)
            if arrivals
            else (0.0, 0.0)
        )
    held = {
        (n, s): footprint(s, config.pools[n].gpus_per_node) for n, s in {(tj.job.pool, tj.job.slots) for tj in trace}
    }
    rec = {
        (j := tj.job).job_id: JobRecord(
            j.job_id,
            j.team,
            j.priority,
            j.pool,
            j.milli / MILLI if j.milli else j.slots,
            j.milli / MILLI if j.milli else held[j.pool, j.slots],
            j.submit_s,
            tj.duration_s,
        )
        for tj in trace
    }
    # A job's true duration is its record's ``duration_s``, and the pool it started in its record's ``pool``:
    # no other table by job id, which would grow with every job the replay has seen (at a million jobs each
    # look-up in one is a miss in the caches).
    multi = {tj.job.job_id: tj.pools for tj in trace if len(tj.pools) > 1}
    # (end, job id, attempt, why): why 0 = its work is done, 1 = its backfill limit
    ends: list[tuple[float, str, int, int]] = []
    # (job id, attempt) of the attempts a preemption stopped: their entries in ``ends`` are stale. Every
    # other attempt leaves the running set at its entry.
    stopped: set[tuple[str, int]] = set()
    estimator = HistoryEstimator()
    estimate = estimator.predict
    # A running job's prediction is fixed when it starts, as a Slurm job's end is by its time limit;
    # a job that ran into its backfill limit has shown its prediction wrong and is not predicted again.
    fixed: dict[str, float | None] = {}
    overran: set[str] = set()
    # A waiting job is predicted from its team's and size's own history once a job of that team and size
    # has finished, and then only such a job's end moves its prediction; before, from the size's or the
    # overall mean, which any end moves (estimate.HistoryEstimator). The pools' queues are told so.
    unseen = {(tj.job.team, tj.job.slots) for tj in trace}

    def predict(job: Job) -> float | None:
        if job.job_id in overran:
            return None
        if job.started_s is not None and job.job_id in fixed:
            return fixed[job.job_id]
        return estimate(job)

    i, n = 0, len(arrivals)
    t = arrivals[0].job.submit_s if arrivals else 0.0
    # Fair-share usage is read only by the orders that rank teams by it; the others skip its decay.
    for st in order:
        st.fair = st.rules.policy.order in (Order.FAIRSHARE, Order.MULTIFACTOR)
    decays = any(st.fair for st in order)
    d = gain = 0.0
    # What the per-event accounting reads of each pool, looked up once: the objects stay the same.
    accounts = [
        (
            st,
            st.tot,
            st.run.free,
            st.run.held,
            st.tot.team_gpu_s,
            st.usage if st.fair else None,
            st.window_end > st.start_t,
        )
        for st in order
    ]
    linked = len(order) > 1
    grace, restart_cost = sim.preempt_grace_s, sim.restart_cost_s
    heappush, heappop = heapq.heappush, heapq.heappop
    PREEMPTION, BACKFILL = How.PREEMPTION, How.BACKFILL
    how_value = {h: h.value for h in How}

    while i < n or any(st.run.jobs or st.waiting.byid for st in order):
        while stopped and ends and (ends[0][1], ends[0][2]) in stopped:
            _, jid, attempt, _ = heappop(ends)
            stopped.remove((jid, attempt))
        nt = min(arrivals[i].job.submit_s if i < n else math.inf, ends[0][0] if ends else math.inf)
        assert nt < math.inf, f"pools {names}: jobs wait with nothing running and nothing to come"
        dt = nt - t
        if dt > 0:
            if decays:  # one step of fair-share decay for every pool's usage below
                d, gain = decay_step(dt, half_life_s)
            for st, tot, free, holding, spent, usage, windowed in accounts:
                busy = tot.capacity - free.total
                tot.busy_gpu_s += busy * dt
                in_window = max(0.0, min(nt, st.window_end) - t) if windowed else dt
                tot.window_busy_gpu_s += busy * in_window
                tot.fragmented_gpu_s += st.stranded * in_window
                for team, g in holding.items():
                    spent[team] = spent.get(team, 0.0) + g * dt
                if usage is not None:
                    advance_in_place(usage, holding, d, gain)
            t = nt
        while ends and ends[0][0] <= t:
            _, jid, attempt, why = heappop(ends)
            if stopped and (jid, attempt) in stopped:
                stopped.remove((jid, attempt))
                continue
            r = rec[jid]
            st = states[r.pool]
            st.last_t = t
            job = st.run.remove(jid)
            fixed.pop(jid, None)
            if why:
                # Held to its limit: stopped at its checkpoint like a victim, back in its pool's queue.
                overran.add(jid)
                st.waiting.add(requeued(job, t, restart_cost), discredited=True)
                r.preempted_at.append(t)
                r.limit_stops.append(t)
                continue
            r.end_s = t
            estimator.observe(job, r.duration_s)
            overran.discard(jid)  # done: the set holds the jobs still to run only
            if unseen:
                unseen.discard((job.team, job.slots))
            if unseen:
                st.run.predictions_changed()
            else:
                st.waiting.repredicted(job.team, job.slots)
            if linked:  # one history predicts the jobs of every pool
                for other in order:
                    if other is not st:
                        other.run.predictions_changed()
        while i < n and arrivals[i].job.submit_s <= t:
            tj = arrivals[i]
            if tj.pools:
                for name in tj.pools:
                    states[name].waiting.add(tj.job if name == tj.job.pool else dataclasses.replace(tj.job, pool=name))
            else:
                states[tj.job.pool].waiting.add(tj.job)
            i += 1
        heads: list[tuple[_PoolState, str | None]] = []
        for st in order:
            run, waiting = st.run, st.waiting
            while True:
                plan, victims = planner(t, st.pool, run, waiting, st.rules, st.usage, predict)
                for v in victims:
                    vid = v.job_id
                    stopped.add((vid, v.attempt))
                    fixed.pop(vid, None)  # its next attempt is predicted when it starts
                    rec[vid].preempted_at.append(t)
                    waiting.add(requeued(v, t, restart_cost), discredited=vid in overran)
                for s in plan.starts:
                    jid = s.job_id
                    job = run.jobs[jid]
                    # predict(job) for a running job
                    pred = None if jid in overran else fixed[jid] if jid in fixed else estimate(job)
                    fixed[jid] = pred
                    how = s.how
                    if how is PREEMPTION and grace:
                        run.remove(jid)
                        job = dataclasses.replace(job, overhead_s=job.overhead_s + grace)
                        run.add(job, pred)
                    r = rec[jid]
                    finish = t + job.overhead_s + r.duration_s - job.done_s
                    why = 0
                    if how is BACKFILL:
                        # Backfilled on its prediction, held to it: it may not delay the head it jumped.
                        assert pred is not None, f"{jid}: backfilled without a prediction"
                        limit = t + job.overhead_s + max(pred - job.done_s, 0.0)
                        if finish > limit:
                            finish, why = limit, 1
                    heappush(ends, (finish, jid, job.attempt, why))
                    if r.first_start_s is None:
                        r.first_start_s = t
                        if jid in multi:
                            # It runs here: out of the other pools' queues, its figures counted here.
                            for name in multi[jid]:
                                if name != st.name:
                                    states[name].waiting.pop(jid)
                            r.pool = st.name
                            if not job.milli:
                                r.footprint = footprint(job.slots, st.pool.gpus_per_node)
                    r.attempts.append((t, s.nodes, how_value[how]))
                # Slots freed by a preemption may let a job the pass already passed over start.
                if not plan.preempted:
                    break
            heads.append((st, plan.head))
        for st, head_id in heads:
            head = st.waiting.byid.get(head_id) if head_id else None
            st.stranded = st.run.free.fragmented(head.slots if head else None)
    totals = []
    for st in order:
        st.tot.makespan_s = max(0.0, st.last_t - st.start_t)  # 0: every job that accepts it ran elsewhere
        st.tot.window_s = st.window_end - st.start_t if st.window_end > st.start_t else st.tot.makespan_s
        totals.append(st.tot)
    return list(rec.values()), totals


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
