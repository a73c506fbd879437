"""One scheduling pass over one pool: which waiting jobs start now, on which nodes, and which
running jobs are preempted for them. Pure: plain data in, a ``Plan`` out. The orchestrator
carries a plan out; the simulator replays traces through the same ``schedule``.

The pass walks the queue in the policy's order:

- **order** — ``fifo``: submission order, classes ignored. Every other order puts the higher
  priority class first, then within a class: ``priority`` submission order; ``sjf`` the
  shortest predicted remaining work; ``fairshare`` the team with the fewest decayed GPU-hours
  (:mod:`traingate.capacity.fairshare`), then submission order; ``multifactor`` Slurm's
  priority/multifactor number, highest first (:func:`multifactor_key`: QOS, fair-share and age
  factors times their weights, so a class is not always ahead of a lower one), then submission order.
  ``hrrn``, highest response ratio next, ignores classes and teams (preemption still goes by class):
  the highest :func:`response_ratio` first, a job's wait over its predicted remaining GPU-seconds
  (at most ``HRRN_CAP_GPU_S``, plus ``HRRN_FLOOR_GPU_S``), then submission order. A small job goes
  ahead of a large one that has not waited as many times longer, and a waiting job's ratio grows
  without bound, so no job starves.
- **aged** (``+aged``, with ``priority``, ``sjf`` or ``fairshare``) — a starvation bound: a waiting job
  submitted at least ``scheduling.starvation_bound_h`` ago ranks ahead of every job submitted since,
  oldest first, whatever its class, team or prediction; the order's own terms rank the rest. Under
  sustained overload the queue's oldest are served in submission order (FIFO's tail), while class and
  fair share still decide among the jobs that have not waited that long.
- **gang** — a job starts only when all of its slots fit at once (:mod:`traingate.capacity.gang`).
- **quotas** — a job whose team would exceed its cap on the pool is passed over; the jobs behind
  it go on. (A preempting class may instead preempt its own team's lower-class jobs.)
- **strict order** — the first job (not held by quota) that cannot start is the *head*; without
  backfill nothing behind it starts, so a wide job is not starved by a stream of narrow ones.
- **backfill** (EASY) — the head gets a reservation: the earliest time it fits if running jobs
  end when predicted. A job behind the head starts now only if it fits now and its predicted
  end comes no later than that reservation, so it cannot delay the head.
- **preemption** — a job of a class with ``preempts: true`` that cannot start may stop running
  jobs of lower classes: least work lost first (GPUs x (progress since their last checkpoint +
  the restart cost)),
  only as many as needed. This happens wherever the job stands in the queue: under ``fifo``
  too, an urgent job gets its slots.
"""

from __future__ import annotations

import enum
import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from traingate.capacity.estimate import Predictor, predicted_remaining
from traingate.capacity.gang import fits, footprint, free_per_node, nodes_needed, place, release, take
from traingate.capacity.jobs import Job, at_risk_s, started
from traingate.capacity.pools import (
    CapacityConfig,
    CapacityError,
    PoolConfig,
    PriorityClass,
    SchedulingConfig,
    SlurmPriorityConfig,
)


class Order(str, enum.Enum):  # noqa: UP042 - str(Order.FIFO) stays 'Order.FIFO'
    FIFO = "fifo"
    PRIORITY = "priority"
    SJF = "sjf"
    FAIRSHARE = "fairshare"
    MULTIFACTOR = "multifactor"
    HRRN = "hrrn"


@dataclass(frozen=True)
class Policy:
    """A queue order plus three switches. Named like ``fairshare+aged+backfill+preempt``."""

    order: Order
    backfill: bool = False
    preempt: bool = False
    aged: bool = False  # the starvation bound (Rules.starvation_bound_s) ranks the long-waiting first

    @property
    def name(self) -> str:
        return (
            self.order.value
            + ("+aged" if self.aged else "")
            + ("+backfill" if self.backfill else "")
            + ("+preempt" if self.preempt else "")
        )

    @classmethod
    def parse(cls, text: str) -> Policy:
        """``ORDER[+aged][+backfill][+preempt]``, e.g. ``sjf``, ``fifo+backfill``,
        ``fairshare+aged+backfill+preempt``."""
        head, *mods = text.strip().split("+")
        orders = [o.value for o in Order]
        if head not in orders:
            raise CapacityError(
                f"policy {text!r}: {head!r} is not an order; use one of {orders}, "
                f"optionally with +aged, +backfill and/or +preempt"
            )
        bad = [m for m in mods if m not in ("aged", "backfill", "preempt")] or [
            m for m in set(mods) if mods.count(m) > 1
        ]
        if bad:
            raise CapacityError(
                f"policy {text!r}: {bad[0]!r} is not a modifier (or is repeated); "
                f"use +aged, +backfill and/or +preempt once each"
            )
        ages = {
            Order.FIFO.value: "serves the oldest first already",
            Order.MULTIFACTOR.value: "ages by its weight_age",
            Order.HRRN.value: "ages by its response ratio",
        }
        if "aged" in mods and head in ages:
            why = ages[head]
            raise CapacityError(f"policy {text!r}: {head} {why}; drop +aged")
        return cls(Order(head), backfill="backfill" in mods, preempt="preempt" in mods, aged="aged" in mods)

    @classmethod
    def default(cls, scheduling: SchedulingConfig) -> Policy:
        """The policy a pool runs: fair share, with the config's backfill and preemption switches, aged
        when the config sets a starvation bound."""
        return cls(
            Order.FAIRSHARE,
            backfill=scheduling.backfill,
            preempt=scheduling.preemption,
            aged=scheduling.starvation_bound_h is not None,
        )


@dataclass(frozen=True)
class Rules:
    """What one pool's scheduler obeys."""

    policy: Policy
    classes: Mapping[str, PriorityClass]
    quotas: Mapping[str, int]  # team -> max slots held on this pool; absent: uncapped
    restart_cost_s: float = 0.0  # what a victim pays to resume; part of the work a preemption loses
    slurm_priority: SlurmPriorityConfig = SlurmPriorityConfig()  # the multifactor order's weights
    # A backfilled job must end this long before the head's reservation (Slurm mode: its bf_resolution).
    backfill_margin_s: float = 0.0
    # An ``aged`` policy's starvation bound: a job submitted this long ago ranks ahead (see the module's doc).
    starvation_bound_s: float | None = None

    @classmethod
    def of(cls, policy: Policy, config: CapacityConfig, pool: str, teams: Iterable[str] = ()) -> Rules:
        """The rules ``policy`` runs under on ``pool`` of ``config``; ``teams``: the teams with jobs there
        (with entitlements, an unlisted team's quota is the default one)."""
        bound_h = config.scheduling.starvation_bound_h
        if policy.aged and bound_h is None:
            raise CapacityError(
                f"policy {policy.name}: +aged needs a starvation bound, but scheduling.starvation_bound_h is "
                f"null; set it (hours, e.g. 24) or drop +aged"
            )
        return cls(
            policy,
            config.priority_classes,
            config.quotas_on(pool, list(teams)),
            config.simulator.restart_cost_s,
            starvation_bound_s=None if bound_h is None or not policy.aged else bound_h * 3600.0,
        )


class How(str, enum.Enum):  # noqa: UP042 - str(How.X) stays 'How.X'
    IN_ORDER = "in order"
    BACKFILL = "backfill"
    PREEMPTION = "preemption"


@dataclass(frozen=True)
class Start:
    job_id: str
    nodes: tuple[int, ...]
    how: How


@dataclass(frozen=True)
class Plan:
    starts: tuple[Start, ...]
    preempted: tuple[str, ...]  # stop these (checkpoint, release, requeue), before the starts
    head: str | None  # the first job in order that could not start (it blocks the rest)
    reserved_s: float | None  # the head's reserved start (backfill only)
    held_by_quota: tuple[str, ...]  # waiting because their team is at its cap on this pool


def queue_order(
    waiting: Sequence[Job],
    policy: Policy,
    classes: Mapping[str, PriorityClass],
    usage: Mapping[str, float],
    predict: Predictor,
    now: float = 0.0,
    weights: SlurmPriorityConfig | None = None,
    starvation_bound_s: float | None = None,
) -> list[Job]:
    """The waiting jobs in the order the policy serves them (a queue view shows this order);
    ``now`` matters to the ``multifactor`` and ``hrrn`` orders and an aged one, ``weights`` to ``multifactor``,
    ``starvation_bound_s`` to an aged one."""
    teams = {j.team for j in waiting} if policy.order is Order.MULTIFACTOR else ()
    return sorted(waiting, key=order_key(policy, classes, usage, predict, now, weights, teams, starvation_bound_s))


def order_key(
    policy: Policy,
    classes: Mapping[str, PriorityClass],
    usage: Mapping[str, float],
    predict: Predictor,
    now: float = 0.0,
    weights: SlurmPriorityConfig | None = None,
    teams: Iterable[str] = (),
    starvation_bound_s: float | None = None,
) -> Callable[[Job], tuple]:
    """The sort key of :func:`queue_order`: the order's terms, then submission time, then the job's id
    (last, so a key names its job). ``teams``: the waiting jobs' teams (``multifactor`` only).

    Along jobs of one class, team and size with one prediction, in submission order, the key never falls
    (the simulator's queue groups, :mod:`traingate.capacity.incremental`, rely on it); under ``+aged`` too,
    as the aged are the earliest submitted, and under ``hrrn``, as the earlier submitted has waited longer.

    >>> from traingate.capacity.pools import _default_classes
    >>> aged = order_key(Policy(Order.PRIORITY, aged=True), _default_classes(), {}, lambda j: None, 30.0,
    ...                  starvation_bound_s=20.0)
    >>> old, new = Job("old", "t", "research", "p", 1, 5.0), Job("new", "t", "urgent", "p", 1, 15.0)
    >>> [j.job_id for j in sorted([new, old], key=aged)]   # old has waited 25 s >= 20: ahead of urgent
    ['old', 'new']
    """
    order = policy.order
    if order is Order.MULTIFACTOR:
        mf = multifactor_key(classes, usage, weights or SlurmPriorityConfig(), now, teams)
        return lambda j: (mf(j), j.submit_s, j.job_id)
    if order is Order.FIFO:
        return lambda j: (j.submit_s, j.job_id)
    if order is Order.HRRN:
        return lambda j: (-response_ratio(j, now, predict), j.submit_s, j.job_id)
    base: Callable[[Job], tuple]
    if order is Order.PRIORITY:
        base = lambda j: (-classes[j.priority].priority, j.submit_s, j.job_id)  # noqa: E731
    elif order is Order.SJF:

        def base(j: Job) -> tuple:
            rem = predicted_remaining(j, predict)
            return (-classes[j.priority].priority, math.inf if rem is None else rem, j.submit_s, j.job_id)

    else:
        assert order is Order.FAIRSHARE, order
        base = lambda j: (-classes[j.priority].priority, usage.get(j.team, 0.0), j.submit_s, j.job_id)  # noqa: E731
    if not policy.aged:
        return base
    assert starvation_bound_s is not None, f"policy {policy.name}: an aged order needs its starvation bound"
    cutoff = now - starvation_bound_s
    # (0, ...) sorts before (1, ...): the aged first, oldest first; the rest by the order's own terms.
    if order is Order.FAIRSHARE:  # the default policy's key, spelled out: a replay computes it per job per pass

        def aged_fairshare(j: Job) -> tuple:
            if j.submit_s <= cutoff:
                return (0, j.submit_s, j.job_id)
            return (1, -classes[j.priority].priority, usage.get(j.team, 0.0), j.submit_s, j.job_id)

        return aged_fairshare

    def aged(j: Job) -> tuple:
        return (0, j.submit_s, j.job_id) if j.submit_s <= cutoff else (1, *base(j))

    return aged


# The ``hrrn`` order's size of a job is its predicted remaining GPU-seconds, at most the cap (a job
# without a prediction counts as the cap), plus the floor. The cap, 4 GPU-hours, was the best of those
# measured on the load sweep's traces: without one a 32-GPU gang job of a day gains ratio hundreds of
# times slower than a 1-GPU hour and waits behind every narrow arrival; with a higher one (8 GPU-hours)
# the plain trace's p95 wait rises above FIFO's. The floor, one 8-GPU node-minute, keeps a job predicted
# to have (almost) nothing left from ranking ahead of every other as soon as it arrives.
HRRN_CAP_GPU_S = 4 * 3600.0
HRRN_FLOOR_GPU_S = 8 * 60.0


def response_ratio(job: Job, now: float, predict: Predictor) -> float:
    """The ``hrrn`` order's rank of a waiting job at ``now``, higher first: seconds since its submission
    per GPU-second of its size, ``min(predicted remaining seconds x GPUs, HRRN_CAP_GPU_S) +
    HRRN_FLOOR_GPU_S`` (``HRRN_CAP_GPU_S`` when it has no prediction). The classic response ratio,
    (wait + size) / size, is 1 + this and ranks alike. It grows without bound as the job waits.

    >>> one = Job("one", "t", "research", "p", 1, 0.0)
    >>> eight = Job("eight", "t", "research", "p", 8, 0.0)
    >>> half_hour = lambda j: 1800.0
    >>> round(response_ratio(one, 3600.0, half_hour), 2)     # 3600 / (1800 + 480)
    1.58
    >>> round(response_ratio(eight, 3600.0, half_hour), 2)   # 3600 / (14400 + 480): 4 GPU-h, the cap
    0.24
    >>> round(response_ratio(one, 3600.0, lambda j: None), 2)  # no prediction: as the cap
    0.24
    """
    rem = predicted_remaining(job, predict)
    size = HRRN_CAP_GPU_S if rem is None else min(rem * job.slots, HRRN_CAP_GPU_S)
    return (now - job.submit_s) / (size + HRRN_FLOOR_GPU_S)


def multifactor_key(
    classes: Mapping[str, PriorityClass],
    usage: Mapping[str, float],
    weights: SlurmPriorityConfig,
    now: float,
    teams: Iterable[str] = (),
) -> Callable[[Job], float]:
    """Minus a job's Slurm priority (priority/multifactor) at ``now``: lower sorts first.

    priority = weight_qos x QOS factor + weight_fairshare x fair-share factor + weight_age x age factor:

    - QOS factor: the job's class priority / the highest class priority (Slurm's QOS priority over the
      highest QOS priority);
    - fair-share factor: Slurm's Fair Tree on a flat tree of teams (one account each, equal shares): the
      ``n`` teams with usage or in ``teams`` (the waiting jobs'; no usage counts as 0) ranked by usage,
      a team's factor ``(n - teams using strictly less) / n``: the least used have 1;
    - age factor: ``min(1, (now - submission) / max_age)``.

    Within a team and class the key never falls as submission time grows, so the queue's groups
    (:mod:`traingate.capacity.incremental`) stay in submission order.

    >>> from traingate.capacity.pools import _default_classes
    >>> key = multifactor_key(_default_classes(), {"a": 5.0, "b": 1.0}, SlurmPriorityConfig(), 3600.0, ["c"])
    >>> round(-key(Job("j", "a", "production", "p", 1, 0.0)), 2)   # 100000 x 0.5 + 10000 x 1/3 + 100 x 1/168
    53333.93
    >>> round(-key(Job("k", "b", "research", "p", 1, 3600.0)), 2)  # 100000 x 0.1 + 10000 x 2/3 + 0
    16666.67
    >>> round(-key(Job("m", "c", "research", "p", 1, 3600.0)), 2)  # c has run nothing: 10000 x 3/3
    20000.0
    """
    top = max((c.priority for c in classes.values()), default=0)
    qos = {name: weights.weight_qos * max(c.priority, 0) / top if top > 0 else 0.0 for name, c in classes.items()}
    use = {t: 0.0 for t in teams}
    use.update(usage)
    ranked = sorted(use.values())
    n = len(ranked)
    fs = {team: weights.weight_fairshare * (n - bisect_left(ranked, u)) / n for team, u in use.items()}
    w_fs, w_age, max_age_s = weights.weight_fairshare, weights.weight_age, weights.max_age_h * 3600.0

    def key(j: Job) -> float:
        age = now - j.submit_s
        age_f = 0.0 if age <= 0 else (1.0 if age >= max_age_s else age / max_age_s)
        return -(qos[j.priority] + fs.get(j.team, w_fs) + w_age * age_f)

    return key


def never_fits(
    job: Job,
    pools: Mapping[str, PoolConfig],
    classes: Mapping[str, PriorityClass],
    quotas: Mapping[str, Mapping[str, int]],
) -> str | None:
    """Why ``job`` could never start (unknown pool or class, wider than the pool, above its
    team's quota), or None. Such a job is refused at submission instead of waiting forever."""
    if job.pool not in pools:
        return f"pool {job.pool!r} is not in the pools config; use one of {sorted(pools)}"
    if job.priority not in classes:
        return f"priority {job.priority!r} is not a priority class; use one of {sorted(classes)}"
    pool = pools[job.pool]
    need = footprint(job.slots, pool.gpus_per_node)
    what = f"{job.slots} GPUs" + (f" (held as {need}: whole nodes)" if need != job.slots else "")
    if need > pool.capacity:
        return (
            f"{what} do not fit pool {job.pool!r}, which has {pool.capacity} "
            f"({pool.nodes} nodes x {pool.gpus_per_node}); lower it or use a bigger pool"
        )
    cap = quotas.get(job.team, {}).get(job.pool)
    if cap is not None and need > cap:
        return (
            f"{what} exceed the quota of team {job.team!r} on {job.pool!r} ({cap}); "
            f"lower it or raise quotas.{job.team}.{job.pool}"
        )
    return None


def predicted_end(job: Job, now: float, predict: Predictor) -> float:
    """When a running job is predicted to release its slots. One without a prediction, or already
    past it, is predicted to run as long again as it has run so far: durations are heavy-tailed,
    and a job that has outlived its prediction tends to run on (taking it to end "now" instead
    would make every reservation "now" and switch backfill off whenever a job overruns)."""
    assert job.started_s is not None
    rem = predicted_remaining(job, predict)
    end = None if rem is None else job.started_s + job.overhead_s + rem
    if end is None or end <= now:
        return now + (now - job.started_s)
    return end


def reserve(
    job: Job, now: float, free: Sequence[int], running: Sequence[Job], gpus_per_node: int, predict: Predictor
) -> float | None:
    """EASY reservation: the earliest time ``job`` fits, releasing running jobs at their predicted ends."""
    f = list(free)
    for end, r in sorted(((predicted_end(r, now, predict), r) for r in running), key=lambda e: (e[0], e[1].job_id)):
        release(f, r.slots, r.nodes, gpus_per_node)
        if place(job.slots, f, gpus_per_node) is not None:
            return end
    return None


def choose_victims(
    job: Job,
    now: float,
    free: Sequence[int],
    running: Sequence[Job],
    gpus_per_node: int,
    classes: Mapping[str, PriorityClass],
    over_quota: int = 0,
    restart_cost_s: float = 0.0,
) -> tuple[Job, ...] | None:
    """Running jobs to preempt so that ``job`` fits, or None when even all candidates would not do.

    Candidates are jobs of strictly lower classes. They are taken least work lost first (GPUs held
    x (seconds since their last checkpoint + ``restart_cost_s``); then the lower class; then the
    latest started) until ``job`` fits and, when its team is ``over_quota`` GPUs above its cap,
    until that many GPUs of the team's own jobs are freed; then every victim not needed after all
    is spared again.
    """
    mine = classes[job.priority].priority
    cands = [
        r for r in running if classes[r.priority].priority < mine and r.started_s is not None and r.started_s < now
    ]
    cands.sort(
        key=lambda r: (
            footprint(r.slots, gpus_per_node) * (at_risk_s(r, now) + restart_cost_s),
            classes[r.priority].priority,
            -(r.started_s or 0.0),
            r.job_id,
        )
    )
    f = list(free)
    chosen: list[Job] = []
    team_freed = 0

    # Releases only add free GPUs: whether the job fits is followed through the nodes each candidate
    # frees (one that fits stays so), not a scan of every node per candidate.
    small = job.slots <= gpus_per_node
    wanted = 0 if small else nodes_needed(job.slots, gpus_per_node)
    whole = 0 if small else f.count(gpus_per_node)
    fit = fits(job.slots, f, gpus_per_node)
    for r in cands:
        if over_quota and r.team != job.team and fit:
            continue  # it fits already; only the team's own jobs can bring it under its cap
        release(f, r.slots, r.nodes, gpus_per_node)
        if not fit:
            if small:
                fit = any(f[n] >= job.slots for n in r.nodes)
            else:
                whole += sum(f[n] == gpus_per_node for n in r.nodes)  # a node it held was not whole before
                fit = whole >= wanted
        chosen.append(r)
        if r.team == job.team:
            team_freed += footprint(r.slots, gpus_per_node)
        if team_freed >= over_quota and fit:
            break
    else:
        return None
    # Each victim, most expensive first, is spared when the job fits without it. Whether it fits is
    # followed through the victim's nodes, not by a scan of every node per victim:
    # ``have`` counts the nodes with room enough for a job of one node, the whole nodes for a gang job.
    gpn = gpus_per_node
    need = job.slots
    have = sum(1 for v in f if v >= need) if small else f.count(gpn)
    for i in range(len(chosen) - 1, -1, -1):
        r = chosen[i]
        before = have
        if small:
            have -= sum(1 for n in r.nodes if f[n] >= need)
            take(f, r.slots, r.nodes, gpn)
            have += sum(1 for n in r.nodes if f[n] >= need)
        else:
            have -= sum(1 for n in r.nodes if f[n] == gpn)  # none of its nodes is whole once it holds them
            take(f, r.slots, r.nodes, gpn)
        mine_freed = footprint(r.slots, gpn) if r.team == job.team else 0
        if team_freed - mine_freed >= over_quota and have >= (1 if small else wanted):
            team_freed -= mine_freed
            del chosen[i]
        else:
            release(f, r.slots, r.nodes, gpn)
            have = before
    return tuple(chosen)


def schedule(
    now: float,
    pool: PoolConfig,
    running: Sequence[Job],
    waiting: Sequence[Job],
    rules: Rules,
    usage: Mapping[str, float],
    predict: Predictor,
) -> Plan:
    """One pass over the pool at ``now``; see the module docstring for the rules.

    ``running`` carry their ``nodes``; ``usage`` is each team's decayed GPU-hours (fair share);
    ``predict`` gives a job's predicted total duration (backfill, sjf) or None.
    """
    gpn = pool.gpus_per_node
    policy = rules.policy
    free = free_per_node(pool.nodes, gpn, running)
    live = {j.job_id: j for j in running}
    held: dict[str, int] = {}
    for j in running:
        held[j.team] = held.get(j.team, 0) + footprint(j.slots, gpn)
    starts: list[Start] = []
    preempted: list[str] = []
    quota_held: list[str] = []
    head: Job | None = None
    shadow: float | None = None

    def evict(victims: tuple[Job, ...]) -> None:
        for v in victims:
            release(free, v.slots, v.nodes, gpn)
            held[v.team] -= footprint(v.slots, gpn)
            del live[v.job_id]
            preempted.append(v.job_id)

    def start(job: Job, nodes: tuple[int, ...] | None, how: How) -> None:
        assert nodes is not None, f"{job.job_id}: started without a placement"
        take(free, job.slots, nodes, gpn)
        held[job.team] = held.get(job.team, 0) + footprint(job.slots, gpn)
        # Counted as running from now for later reservations and victim choices in this pass.
        live[job.job_id] = started(job, now, nodes)
        starts.append(Start(job.job_id, nodes, how))

    for job in queue_order(
        waiting, policy, rules.classes, usage, predict, now, rules.slurm_priority, rules.starvation_bound_s
    ):
        need = footprint(job.slots, gpn)
        cap = rules.quotas.get(job.team)
        over = 0 if cap is None else max(0, held.get(job.team, 0) + need - cap)
        can_preempt = policy.preempt and rules.classes[job.priority].preempts
        if over:
            # Its team is at its cap: only its own lower-class jobs can make room, by preemption.
            victims = (
                choose_victims(job, now, free, list(live.values()), gpn, rules.classes, over, rules.restart_cost_s)
                if can_preempt
                else None
            )
            if victims is None:
                quota_held.append(job.job_id)
            else:
                evict(victims)
                start(job, place(job.slots, free, gpn), How.PREEMPTION)
            continue
        if head is None:
            nodes = place(job.slots, free, gpn)
            if nodes is not None:
                start(job, nodes, How.IN_ORDER)
                continue
        elif shadow is not None:
            rem = predicted_remaining(job, predict)
            if rem is not None and now + job.overhead_s + rem + rules.backfill_margin_s <= shadow:
                nodes = place(job.slots, free, gpn)
                if nodes is not None:
                    start(job, nodes, How.BACKFILL)
                    continue
        if can_preempt:
            victims = choose_victims(job, now, free, list(live.values()), gpn, rules.classes, 0, rules.restart_cost_s)
            if victims is not None:
                evict(victims)
                start(job, place(job.slots, free, gpn), How.PREEMPTION)
                continue
        if head is None:
            head = job
            if policy.backfill:
                shadow = reserve(job, now, free, list(live.values()), gpn, predict)
            elif not policy.preempt:
                break  # strict order: nothing behind the head may start
    return Plan(tuple(starts), tuple(preempted), head.job_id if head else None, shadow, tuple(quota_held))
