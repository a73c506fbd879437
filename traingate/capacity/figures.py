"""The figures platform teams read from a replay, per pool and over all pools, computed from the
schedule alone (each job's submission, attempts and end), so they hold for any policy.

- **Queueing delay** (wait): first start minus submission. Reported as mean, p50, p95, p99 and max;
  percentiles interpolate linearly between the sorted waits (numpy's default), so with waits
  0, 55 and 100 s the p50 is 55 s and the p95 is 95.5 s.
- **Bounded slowdown** (Feitelson et al., "Theory and Practice in Parallel Job Scheduling",
  JSSPP'97): ``max(1, (end - submit) / max(run, 10 s))`` where ``run`` is the job's work (its
  duration in the trace). The 10 s bound keeps a few-second job that waited a minute from
  dominating the mean. Reported as mean, p95 and max.
- **Waits by job size**: the same wait figures for jobs grouped by GPUs asked (``SIZE_BUCKETS``).
- **Makespan**: first submission to last end.
- **Utilisation**: GPU-seconds held over capacity x time while jobs keep arriving (first to last
  submission; the whole replay when all arrive at once), as the comparison table has it; over
  all pools, each pool's held and available GPU-seconds count over its own window.
- **Preemptions**: every attempt stopped to make room (a job stopped twice counts twice), and
  every start the preemption rule made (an urgent job jumping over the queue and running work;
  it pays the victims' checkpoint grace even when no victim was needed).
- **GPU-hours lost to preemption**: for each job that was stopped or started by preemption, the
  GPU time it held beyond its work: lost progress since its last checkpoint, restart cost, grace.
- **Limit stops**: backfilled attempts stopped at their limit (their predicted end) unfinished and
  requeued, and the GPU time their jobs held beyond their work. A job that lost time to both
  preemption and its limit splits it by its number of each (a preemptive start counts as one).
- **Over time** (:func:`timeseries`): the replay cut into equal intervals from first submission
  to last end; per interval the mean and max queue length (jobs submitted, not running, not
  finished: requeued victims included), mean running jobs, mean GPUs held and their share of
  capacity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from traingate.capacity.simulate import JobRecord, SimResult

BSLD_BOUND_S = 10.0
ALL = "all"  # the scope of every pool together
# (largest GPU count in the bucket, its name); a job falls in the first bucket that holds it.
SIZE_BUCKETS: tuple[tuple[float, str], ...] = (
    (0.999, "<1"),  # a share of a GPU (requests are thousandths)
    (1, "1"),
    (2, "2"),
    (4, "3-4"),
    (8, "5-8"),
    (16, "9-16"),
    (64, "17-64"),
    (math.inf, "65+"),
)
SERIES_BINS = 1000


def size_bucket(gpus: float) -> str:
    return next(name for top, name in SIZE_BUCKETS if gpus <= top)


@dataclass(frozen=True)
class Waits:
    jobs: int
    mean_s: float
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float


@dataclass(frozen=True)
class Figures:
    scope: str  # a pool's name, or ALL
    jobs: int
    capacity: int  # GPUs
    waits: Waits
    bsld_mean: float
    bsld_p95: float
    bsld_max: float
    makespan_s: float
    asked_gpu_h: float  # each job's GPUs asked x its work: a fraction as asked, whole nodes for a job wider than one
    held_gpu_h: float
    utilisation: float
    preemptions: int  # attempts stopped to make room
    preemptive_starts: int  # starts made by the preemption rule
    lost_gpu_h: float  # GPU time held beyond the work by jobs stopped or started by preemption
    limit_stops: int  # backfilled attempts stopped at their limit (their predicted end) and requeued
    lost_limit_gpu_h: float  # GPU time held beyond the work by jobs stopped at a limit
    waits_by_size: dict[str, Waits]  # SIZE_BUCKETS names that have jobs, in bucket order


def waits_of(values: Iterable[float]) -> Waits:
    w = np.fromiter(values, dtype=float)
    if not len(w):
        return Waits(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    p50, p95, p99 = np.percentile(w, [50, 95, 99])
    return Waits(len(w), float(w.mean()), float(p50), float(p95), float(p99), float(w.max()))


@dataclass(frozen=True)
class _Schedule:
    """A replay's records as arrays: one entry per job, and one per attempt."""

    pools: list[str]  # sorted; ``pool`` holds indices into it
    pool: np.ndarray
    submit: np.ndarray
    start: np.ndarray  # first start
    end: np.ndarray
    work: np.ndarray  # the job's duration
    footprint: np.ndarray  # GPUs held while it runs
    slots: np.ndarray  # GPUs asked
    stops: np.ndarray  # preemptions of the job
    limit_stops: np.ndarray  # backfilled attempts stopped at their limit
    a_job: np.ndarray  # per attempt: its job's index
    a_start: np.ndarray
    a_end: np.ndarray
    a_stopped: np.ndarray  # ended by a preemption (every attempt but a job's last)
    a_preemptive: np.ndarray  # started by the preemption rule

    @property
    def preemptive_starts(self) -> np.ndarray:
        return np.bincount(self.a_job, weights=self.a_preemptive, minlength=len(self.submit))

    @property
    def held_gpu_s(self) -> np.ndarray:
        """Per job: GPU-seconds held over all its attempts."""
        return np.bincount(self.a_job, weights=self.a_end - self.a_start, minlength=len(self.submit)) * self.footprint


def _schedule(recs: Sequence[JobRecord]) -> _Schedule:
    pools = sorted({r.pool for r in recs})
    code = {p: k for k, p in enumerate(pools)}
    n = len(recs)
    a_job: list[int] = []
    a_start: list[float] = []
    a_end: list[float] = []
    a_stopped: list[bool] = []
    a_preemptive: list[bool] = []
    for k, r in enumerate(recs):
        assert r.end_s is not None, f"{r.job_id} has not ended"
        m = len(r.attempts)
        a_job += [k] * m
        a_start += [a[0] for a in r.attempts]
        a_end += [*r.preempted_at, r.end_s]
        a_stopped += [True] * (m - 1) + [False]
        a_preemptive += [a[2] == "preemption" for a in r.attempts]

    def col(values: Iterable[float], dtype: type = float) -> np.ndarray:
        return np.fromiter(values, dtype=dtype, count=n)

    return _Schedule(
        pools=pools,
        pool=col((code[r.pool] for r in recs), int),
        submit=col(r.submit_s for r in recs),
        start=col(r.first_start_s or 0.0 for r in recs),
        end=col(r.end_s or 0.0 for r in recs),
        work=col(r.duration_s for r in recs),
        footprint=col(r.footprint for r in recs),
        slots=col(r.slots for r in recs),
        stops=col((r.preemptions for r in recs), int),
        limit_stops=col((len(r.limit_stops) for r in recs), int),
        a_job=np.array(a_job, dtype=int),
        a_start=np.array(a_start, dtype=float),
        a_end=np.array(a_end, dtype=float),
        a_stopped=np.array(a_stopped, dtype=bool),
        a_preemptive=np.array(a_preemptive, dtype=bool),
    )


def figures(res: SimResult) -> list[Figures]:
    """One ``Figures`` per pool with jobs (sorted by name), then ``ALL``."""
    capacity = {p.pool: p.capacity for p in res.pools}
    sched = _schedule(res.records)
    masks = [sched.pool == k for k in range(len(sched.pools))]
    use = [_window_use(sched, m) for m in masks]
    out = [
        _figures(sched, name, m, capacity[name], held, capacity[name] * span)
        for name, m, (held, span) in zip(sched.pools, masks, use)
    ]
    # Over all pools, each pool counts over its own arrival window (as the comparison table has it).
    held = sum(h for h, _ in use)
    room = sum(capacity[name] * span for name, (_, span) in zip(sched.pools, use))
    every = np.ones(len(sched.submit), dtype=bool)
    out.append(_figures(sched, ALL, every, sum(capacity[p] for p in sched.pools), held, room))
    return out


def _window_use(sched: _Schedule, mask: np.ndarray) -> tuple[float, float]:
    """GPU-seconds held while the masked jobs arrive (first to last submission; the whole replay
    when all arrive at once), and that window's length."""
    if not mask.any():
        return 0.0, 0.0
    first, last_submit = float(sched.submit[mask].min()), float(sched.submit[mask].max())
    a, b = (first, last_submit) if last_submit > first else (first, float(sched.end[mask].max()))
    am = mask[sched.a_job]
    overlap = np.clip(np.minimum(sched.a_end[am], b) - np.maximum(sched.a_start[am], a), 0.0, None)
    return float((sched.footprint[sched.a_job[am]] * overlap).sum()), b - a


def _figures(
    sched: _Schedule, scope: str, mask: np.ndarray, capacity: int, held_in_window: float, room: float
) -> Figures:
    """``room``: the GPU-seconds available over the arrival window."""
    submit, end, work = sched.submit[mask], sched.end[mask], sched.work[mask]
    waits = sched.start[mask] - submit
    bsld = np.maximum(1.0, (end - submit) / np.maximum(work, BSLD_BOUND_S)) if mask.any() else np.ones(1)
    bucket = np.searchsorted([top for top, _ in SIZE_BUCKETS], sched.slots[mask], side="left")
    held = sched.held_gpu_s[mask]
    pre = sched.preemptive_starts[mask]
    stops = sched.stops[mask]
    limits = sched.limit_stops[mask]
    # Held beyond the work; a job that lost time both ways splits it by its number of each.
    lost = np.maximum(held - sched.footprint[mask] * work, 0.0)
    events = stops + pre + limits
    share = np.divide(stops + pre, events, out=np.zeros(len(events)), where=events > 0)
    lost_pre = float((lost * share).sum())
    lost_limit = float((lost * np.where(events > 0, 1.0 - share, 0.0)).sum())
    return Figures(
        scope=scope,
        jobs=int(mask.sum()),
        capacity=capacity,
        waits=waits_of(waits),
        bsld_mean=float(bsld.mean()),
        bsld_p95=float(np.percentile(bsld, 95)),
        bsld_max=float(bsld.max()),
        makespan_s=float(end.max() - submit.min()) if mask.any() else 0.0,
        asked_gpu_h=float((sched.footprint[mask] * work).sum()) / 3600.0,
        held_gpu_h=float(held.sum()) / 3600.0,
        utilisation=held_in_window / room if room > 0 else 0.0,
        preemptions=int(stops.sum()),
        preemptive_starts=int(pre.sum()),
        lost_gpu_h=lost_pre / 3600.0,
        limit_stops=int(limits.sum()),
        lost_limit_gpu_h=lost_limit / 3600.0,
        waits_by_size={
            name: waits_of(waits[bucket == k]) for k, (_, name) in enumerate(SIZE_BUCKETS) if (bucket == k).any()
        },
    )


@dataclass(frozen=True)
class Interval:
    scope: str
    start_s: float
    end_s: float
    queued_mean: float
    queued_max: int
    running_mean: float
    busy_gpus_mean: float
    capacity: int

    @property
    def utilisation(self) -> float:
        return self.busy_gpus_mean / self.capacity if self.capacity else 0.0


def timeseries(res: SimResult, bins: int = SERIES_BINS) -> list[Interval]:
    """Queue length, running jobs and GPUs held over ``bins`` equal intervals from the first
    submission to the last end, per pool (sorted) and then over ``ALL`` pools; exact time
    averages of the step functions, not samples."""
    if not res.records:
        return []
    capacity = {p.pool: p.capacity for p in res.pools}
    sched = _schedule(res.records)
    t0, t1 = float(sched.submit.min()), float(sched.end.max())
    edges = np.linspace(t0, t1, bins + 1) if t1 > t0 else np.array([t0, t0 + 1.0])
    every = np.ones(len(sched.submit), dtype=bool)
    scopes = [(name, sched.pool == k, capacity[name]) for k, name in enumerate(sched.pools)]
    scopes.append((ALL, every, sum(capacity[p] for p in sched.pools)))
    out: list[Interval] = []
    for scope, mask, cap in scopes:
        queued, running, busy = _steps(sched, mask)
        qm, qx = _bin(queued, edges, with_max=True)
        rm, _ = _bin(running, edges)
        bm, _ = _bin(busy, edges)
        out += [
            Interval(scope, float(a), float(b), float(q), int(x), float(rn), float(g), cap)
            for a, b, q, x, rn, g in zip(edges[:-1], edges[1:], qm, qx, rm, bm)
        ]
    return out


_Step = tuple[np.ndarray, np.ndarray]  # (change times, ascending; value from each time to the next)


def _steps(sched: _Schedule, mask: np.ndarray) -> tuple[_Step, _Step, _Step]:
    am = mask[sched.a_job]
    starts, ends = sched.a_start[am], sched.a_end[am]
    stopped = sched.a_end[am & sched.a_stopped]  # back in the queue until the job's next attempt
    submit = sched.submit[mask]
    queued = _step(
        np.concatenate([submit, starts, stopped]),
        np.concatenate([np.ones(len(submit)), -np.ones(len(starts)), np.ones(len(stopped))]),
    )
    times = np.concatenate([starts, ends])
    running = _step(times, np.concatenate([np.ones(len(starts)), -np.ones(len(ends))]))
    fp = sched.footprint[sched.a_job[am]]
    busy = _step(times, np.concatenate([fp, -fp]))
    return queued, running, busy


def _step(t: np.ndarray, d: np.ndarray) -> _Step:
    order = np.argsort(t, kind="stable")
    t, d = t[order], d[order]
    uniq, first = np.unique(t, return_index=True)
    return uniq, np.cumsum(np.add.reduceat(d, first)) if len(t) else np.zeros(0)


def _bin(step: _Step, edges: np.ndarray, with_max: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Time average (and max) of a step function over each interval between ``edges``."""
    t, v = step
    if not len(t):
        z = np.zeros(len(edges) - 1)
        return z, z
    area = np.concatenate([[0.0], np.cumsum(v[:-1] * np.diff(t))])  # integral from t[0] to t[k]

    def integral(x: np.ndarray) -> np.ndarray:
        j = np.searchsorted(t, x, side="right") - 1
        inside = j >= 0
        jj = np.maximum(j, 0)
        return np.where(inside, area[jj] + v[jj] * (x - t[jj]), 0.0)

    mean = np.diff(integral(edges)) / np.diff(edges)
    if not with_max:
        return mean, mean
    vv = np.concatenate([[0.0], v])  # vv[j + 1]: the value from t[j]; vv[0]: before t[0]
    at_start = np.searchsorted(t, edges[:-1], side="right")  # index into vv of the value at each start
    last = np.maximum(np.searchsorted(t, edges[1:], side="left"), at_start)  # the last value before each end
    peak = np.maximum(np.maximum.reduceat(vv, at_start), vv[last])
    return mean, peak
