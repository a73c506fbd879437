"""The live queue of one pool, as plain data: what each training job publishes about itself
(an ``Entry``) and what a waiting job decides from everyone's entries (a ``Decision``).

Every job waiting for slots runs the same pure decision over the same published entries, so
there is no scheduler process to keep alive: the policy of :mod:`traingate.capacity.policy`
(``schedule``: class, fair share, quotas, gang placement, backfill, preemption) is evaluated by
each waiter, and a waiter starts only when the plan starts *it*. Prefect carries the decision out
(``tasks/slots.py``): the entries are Prefect Variables, the slots a global concurrency limit
per pool (strict, leased), a team's cap a limit per team and pool, and a one-slot limit per pool
serializes the moment of starting so two jobs never plan on the same free GPUs.

>>> from traingate.capacity.pools import parse_config
>>> cfg = parse_config({"pools": {"p": {"gpus_per_node": 2, "nodes": 2, "price_per_gpu_hour": 1.0,
...                                     "worker": "process"}}, "quotas": {"b": {"p": 2}}})
>>> run = Entry("r1-full", "r1", "full", "a", "research", "p", 4, submit_s=0.0, state=RUNNING,
...             beat_s=10.0, started_s=1.0, nodes=(0, 1))
>>> urgent = Entry("u1-full", "u1", "full", "b", "urgent", "p", 2, submit_s=5.0, beat_s=10.0)
>>> d = decide("u1-full", [run, urgent], cfg, now=10.0, usage={})
>>> d.start, d.victims, d.nodes
(True, ('r1-full',), (0,))
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from traingate.capacity.fairshare import decayed_usage
from traingate.capacity.gang import footprint, free_per_node, place, take
from traingate.capacity.jobs import Job
from traingate.capacity.policy import How, Policy, Rules, queue_order, reserve, schedule
from traingate.capacity.pools import CapacityConfig

WAITING = "waiting"
RUNNING = "running"
STALE_S = 60.0  # an entry not refreshed for this long belongs to a dead orchestrator: ignored


@dataclass(frozen=True)
class Entry:
    """One training job (a stage attempt) as the queue sees it."""

    job_id: str
    run_id: str
    stage: str
    team: str
    priority: str
    pool: str
    slots: int
    submit_s: float
    state: str = WAITING
    beat_s: float = 0.0  # last refresh (wall clock, seconds)
    started_s: float | None = None
    nodes: tuple[int, ...] = ()
    checkpoint_every_s: float | None = None  # how much work a preemption may lose
    est_duration_s: float | None = None  # predicted run time (backfill); None: unknown
    attempt: int = 0  # +1 per preemption
    progress: str = ""  # e.g. "step 40/100"
    host: str = ""
    pid: int = 0
    user: str = ""  # the OS user the pool's authority saw on the job's connection (peer credentials)

    def job(self) -> Job:
        return Job(
            self.job_id,
            self.team,
            self.priority,
            self.pool,
            self.slots,
            self.submit_s,
            est_duration_s=self.est_duration_s,
            checkpoint_every_s=self.checkpoint_every_s,
            started_s=self.started_s,
            nodes=tuple(self.nodes),
            attempt=self.attempt,
        )

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Entry:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["nodes"] = tuple(kw.get("nodes") or ())
        return cls(**kw)


def key(job_id: str) -> str:
    """A Prefect-variable-safe name for a job id (lowercase letters, digits, dashes, underscores).

    >>> key("Run_7/full")
    'run_7-full'
    """
    return re.sub(r"[^a-z0-9_-]+", "-", job_id.lower())[:200]


def fresh(entries: Sequence[Entry], now: float, stale_s: float = STALE_S) -> list[Entry]:
    return [e for e in entries if now - e.beat_s <= stale_s]


@dataclass(frozen=True)
class Decision:
    start: bool
    nodes: tuple[int, ...] = ()
    victims: tuple[str, ...] = ()  # running jobs to preempt (this job starts by preemption)
    position: int = 0  # 1 = next in the policy's order
    waiting: int = 0  # jobs waiting on the pool
    est_start_s: float | None = None  # earliest start if running jobs end as predicted
    why: str = ""


def rules_for(cfg: CapacityConfig, pool: str, teams: Sequence[str] = ()) -> Rules:
    """The rules of ``pool``; ``teams``: the teams with jobs there (with entitlements, an unlisted team's
    quota is the default one)."""
    return Rules.of(Policy.default(cfg.scheduling), cfg, pool, teams)


def _predict(job: Job) -> float | None:
    return job.est_duration_s


def placed(running: Sequence[Entry], gpus_per_node: int, nodes: int) -> list[Job]:
    """Running jobs with a consistent placement: each keeps its recorded nodes when they are still
    free, else gets the best fit in start order. (Slots are a counter on the server; nodes are
    the scheduler's bookkeeping, so two jobs that started from different snapshots are re-placed.)
    A job that fits nowhere (possible only after such a race) is left out of the plan: a waiter the
    plan then starts into its room fails to get the slots from the server's limit and keeps waiting.
    Starts are serialized per pool (``tasks/slots.py``), so records rarely conflict at all."""
    free = [gpus_per_node] * nodes
    out: list[Job] = []
    for e in sorted(running, key=lambda e: (e.started_s or 0.0, e.job_id)):
        need = footprint(e.slots, gpus_per_node)
        rec = tuple(e.nodes)
        ok = (
            bool(rec)
            and all(0 <= n < nodes for n in rec)
            and (
                free[rec[0]] >= e.slots
                if e.slots <= gpus_per_node
                else len(rec) * gpus_per_node >= need and all(free[n] == gpus_per_node for n in rec)
            )
        )
        where = rec if ok else place(e.slots, free, gpus_per_node)
        if where is None:  # left out of the plan's bookkeeping; the server's limit still counts it
            continue
        take(free, e.slots, tuple(where), gpus_per_node)
        out.append(dataclasses.replace(e.job(), nodes=tuple(where)))
    return out


def usage_now(
    history: Mapping[str, tuple[float, float]], running: Sequence[Entry], now: float, half_life_s: float
) -> dict[str, float]:
    """Decayed GPU-hours per team: finished work (``team -> (usage, as_of_s)``, decayed to now)
    plus the running jobs' work so far."""
    out = {team: u * 2.0 ** (-(now - as_of) / half_life_s) for team, (u, as_of) in history.items()}
    for team, u in decayed_usage(
        [(e.team, e.slots, e.started_s or now, None) for e in running], now, half_life_s
    ).items():
        out[team] = out.get(team, 0.0) + u
    return out


def fold_usage(
    prev: tuple[float, float] | None, slots: int, start_s: float, end_s: float, half_life_s: float
) -> tuple[float, float]:
    """A team's stored usage after one more finished interval, as of ``end_s``.

    >>> u, t = fold_usage(None, 8, 0.0, 3600.0, 3600.0)
    >>> round(u, 4), t
    (5.7708, 3600.0)
    """
    u, as_of = prev if prev is not None else (0.0, end_s)
    u = u * 2.0 ** (-(end_s - as_of) / half_life_s) if end_s >= as_of else u
    return u + decayed_usage([("t", slots, start_s, end_s)], end_s, half_life_s).get("t", 0.0), end_s


def decide(me: str, entries: Sequence[Entry], cfg: CapacityConfig, now: float, usage: Mapping[str, float]) -> Decision:
    """Whether waiting job ``me`` starts now on its pool, given every fresh entry of that pool."""
    mine = next(e for e in entries if e.job_id == me)
    pool = cfg.pools[mine.pool]
    gpn = pool.gpus_per_node
    on_pool = [e for e in entries if e.pool == mine.pool]
    running = placed([e for e in on_pool if e.state == RUNNING], gpn, pool.nodes)
    waiting = [e.job() for e in on_pool if e.state == WAITING]
    rules = rules_for(cfg, mine.pool, [e.team for e in on_pool])
    plan = schedule(now, pool, running, waiting, rules, usage, _predict)
    order = [
        j.job_id
        for j in queue_order(
            waiting, rules.policy, rules.classes, usage, _predict, now, starvation_bound_s=rules.starvation_bound_s
        )
    ]
    position = order.index(me) + 1
    for s in plan.starts:
        if s.job_id == me:
            victims = plan.preempted if s.how is How.PREEMPTION else ()
            return Decision(True, s.nodes, tuple(victims), position, len(order), now, s.how.value)
    free = free_per_node(pool.nodes, gpn, running)
    est = now if place(mine.slots, free, gpn) is not None else reserve(mine.job(), now, free, running, gpn, _predict)
    if me in plan.held_by_quota:
        cap = rules.quotas.get(mine.team)
        why = f"team {mine.team} is at its quota of {cap} slots on {mine.pool}"
    elif plan.head is not None and plan.head != me:
        why = f"behind {plan.head}"
    else:
        why = f"{mine.slots} slots not free on {mine.pool}"
    return Decision(False, (), (), position, len(order), est, why)


def describe_wait(d: Decision, waited_s: float, now: float) -> str:
    """The line a waiting job prints.

    >>> describe_wait(Decision(False, position=2, waiting=3, est_start_s=130.0, why="behind a"), 12.0, 100.0)
    'waiting for slots: position 2 of 3, waited 12 s, estimated start in 30 s (behind a)'
    """
    est = (
        "unknown"
        if d.est_start_s is None or not math.isfinite(d.est_start_s)
        else f"in {max(0.0, d.est_start_s - now):.0f} s"
    )
    return (
        f"waiting for slots: position {d.position} of {d.waiting}, waited {waited_s:.0f} s, "
        f"estimated start {est} ({d.why})"
    )
