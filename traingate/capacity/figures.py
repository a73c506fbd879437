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
    held_gpu_h: float
    utilisation: float
    preemptions: int  # attempts stopped to make room
    preemptive_starts: int  # starts made by the preemption rule
    lost_gpu_h: float  # GPU time held beyond the work by jobs stopped or started by preemption
    waits_by_size: dict[str, Waits]  # SIZE_BUCKETS names that have jobs, in bucket order


def waits_of(values: Iterable[float]) -> Waits:
    w = np.fromiter(values, dtype=float)
    if not len(w):
        return Waits(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    p50, p95, p99 = np.percentile(w, [50, 95, 99])
    return Waits(len(w), float(w.mean()), float(p50), float(p95), float(p99), float(w.max()))


def bounded_slowdown(r: JobRecord) -> float:
    assert r.end_s is not None, f"{r.job_id} has not ended"
    return max(1.0, (r.end_s - r.submit_s) / max(r.duration_s, BSLD_BOUND_S))


def _spans(r: JobRecord) -> list[tuple[float, float]]:
    """(start, end) of each attempt."""
    assert r.end_s is not None, f"{r.job_id} has not ended"
    return [(a[0], e) for a, e in zip(r.attempts, [*r.preempted_at, r.end_s])]


def _held_s(r: JobRecord) -> float:
    return sum(e - s for s, e in _spans(r))


def figures(res: SimResult) -> list[Figures]:
    """One ``Figures`` per pool with jobs (sorted by name), then ``ALL``."""
    capacity = {p.pool: p.capacity for p in res.pools}
    by_pool: dict[str, list[JobRecord]] = {}
    for r in res.records:
        by_pool.setdefault(r.pool, []).append(r)
    use = {name: _window_use(recs) for name, recs in by_pool.items()}
    out = [_figures(name, by_pool[name], capacity[name], *use[name]) for name in sorted(by_pool)]
    # Over all pools, each pool counts over its own arrival window (as the comparison table has it).
    held = sum(h for h, _ in use.values())
    room = sum(capacity[name] * span for name, (_, span) in use.items())
    out.append(_figures(ALL, res.records, sum(capacity[name] for name in by_pool), held, room, per_gpu=False))
    return out


def _window_use(recs: Sequence[JobRecord]) -> tuple[float, float]:
    """GPU-seconds held while jobs arrive (first to last submission; the whole replay when all
    arrive at once), and that window's length."""
    first = min((r.submit_s for r in recs), default=0.0)
    last_submit = max((r.submit_s for r in recs), default=0.0)
    last_end = max((r.end_s or 0.0 for r in recs), default=0.0)
    a, b = (first, last_submit) if last_submit > first else (first, last_end)
    return sum(r.footprint * max(0.0, min(e, b) - max(s, a)) for r in recs for s, e in _spans(r)), b - a


def _figures(
    scope: str, recs: Sequence[JobRecord], capacity: int, held_in_window: float, span: float, per_gpu: bool = True
) -> Figures:
    """``per_gpu``: ``span`` is the window's length, to be multiplied by ``capacity``; else it is
    already GPU-seconds of room."""
    bsld = np.array([bounded_slowdown(r) for r in recs]) if recs else np.ones(1)
    sizes: dict[str, list[float]] = {}
    for r in recs:
        sizes.setdefault(size_bucket(r.slots), []).append(r.wait_s)
    touched = [r for r in recs if r.preemptions or any(a[2] == "preemption" for a in r.attempts)]
    lost = sum(_held_s(r) * r.footprint for r in touched) - sum(r.footprint * r.duration_s for r in touched)
    first = min((r.submit_s for r in recs), default=0.0)
    last_end = max((r.end_s or 0.0 for r in recs), default=0.0)
    room = capacity * span if per_gpu else span
    return Figures(
        scope=scope,
        jobs=len(recs),
        capacity=capacity,
        waits=waits_of(r.wait_s for r in recs),
        bsld_mean=float(bsld.mean()),
        bsld_p95=float(np.percentile(bsld, 95)),
        bsld_max=float(bsld.max()),
        makespan_s=last_end - first,
        held_gpu_h=sum(_held_s(r) * r.footprint for r in recs) / 3600.0,
        utilisation=held_in_window / room if room > 0 else 0.0,
        preemptions=sum(r.preemptions for r in recs),
        preemptive_starts=sum(1 for r in recs for a in r.attempts if a[2] == "preemption"),
        lost_gpu_h=max(0.0, lost) / 3600.0,  # max: float dust when nothing was lost
        waits_by_size={name: waits_of(sizes[name]) for _, name in SIZE_BUCKETS if name in sizes},
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
    capacity = {p.pool: p.capacity for p in res.pools}
    pools = sorted({r.pool for r in res.records})
    if not res.records:
        return []
    t0 = min(r.submit_s for r in res.records)
    t1 = max(r.end_s or 0.0 for r in res.records)
    edges = np.linspace(t0, t1, bins + 1) if t1 > t0 else np.array([t0, t0 + 1.0])
    out: list[Interval] = []
    for scope in [*pools, ALL]:
        recs = res.records if scope == ALL else [r for r in res.records if r.pool == scope]
        cap = sum(capacity[p] for p in pools) if scope == ALL else capacity[scope]
        queued, running, busy = _steps(recs)
        qm, qx = _bin(queued, edges, with_max=True)
        rm, _ = _bin(running, edges)
        bm, _ = _bin(busy, edges)
        out += [
            Interval(scope, float(a), float(b), float(q), int(x), float(rn), float(g), cap)
            for a, b, q, x, rn, g in zip(edges[:-1], edges[1:], qm, qx, rm, bm)
        ]
    return out


_Step = tuple[np.ndarray, np.ndarray]  # (change times, ascending; value from each time to the next)


def _steps(recs: Sequence[JobRecord]) -> tuple[_Step, _Step, _Step]:
    tq: list[float] = []
    dq: list[float] = []
    tr: list[float] = []
    dr: list[float] = []
    db: list[float] = []
    for r in recs:
        tq.append(r.submit_s)
        dq.append(1)
        for k, (s, e) in enumerate(_spans(r)):
            tq.append(s)
            dq.append(-1)
            tr += [s, e]
            dr += [1, -1]
            db += [r.footprint, -r.footprint]
            if k < r.preemptions:  # stopped at e: back in the queue until its next attempt
                tq.append(e)
                dq.append(1)
    return _step(tq, dq), _step(tr, dr), _step(tr, db)


def _step(times: list[float], deltas: list[float]) -> _Step:
    t = np.asarray(times, dtype=float)
    d = np.asarray(deltas, dtype=float)
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
