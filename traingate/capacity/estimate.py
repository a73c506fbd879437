"""Predicted durations. Backfill and shortest-job-first run on predictions, never on the true
duration (which a scheduler cannot know). ``HistoryEstimator.predict`` is, in order:

1. the job's own ``est_duration_s`` when its submitter gave one (in traingate: the canary's
   sizing estimate of the full stage);
2. else the mean duration of the finished jobs of the same team and the same slots;
3. else the mean of the finished jobs with the same slots, any team;
4. else the mean of all finished jobs;
5. else ``None`` (nothing has finished yet): such a job is never backfilled and sorts last
   under shortest-job-first.

Only jobs that have *finished* are observed, so a replay predicts from the past alone.

>>> from traingate.capacity.jobs import Job
>>> est = HistoryEstimator()
>>> est.observe(Job("a", "vision", "research", "p", 1, 0.0), 100.0)
>>> est.observe(Job("b", "vision", "research", "p", 1, 0.0), 300.0)
>>> est.observe(Job("c", "speech", "research", "p", 8, 0.0), 1000.0)
>>> est.predict(Job("d", "vision", "research", "p", 1, 0.0))    # same team and size
200.0
>>> est.predict(Job("e", "speech", "research", "p", 1, 0.0))    # same size, any team
200.0
>>> est.predict(Job("f", "speech", "research", "p", 4, 0.0))    # everything
466.6666666666667
"""

from __future__ import annotations

from collections.abc import Callable

from traingate.capacity.jobs import Job

Predictor = Callable[[Job], "float | None"]


class HistoryEstimator:
    def __init__(self) -> None:
        self._by_team_size: dict[tuple[str, int], list[float]] = {}  # [sum, count]
        self._by_size: dict[int, list[float]] = {}
        self._all = [0.0, 0.0]
        # (team, slots) -> its last prediction; and which of them came from the size's or the overall
        # mean, dropped with it when a job of that size, or any job, is observed.
        self._memo: dict[tuple[str, int], float | None] = {}
        self._from_size: dict[int, set[tuple[str, int]]] = {}
        self._from_all: set[tuple[str, int]] = set()

    def observe(self, job: Job, duration_s: float) -> None:
        """Record a finished job's whole run (its work, without queueing or restart overhead)."""
        key = (job.team, job.slots)
        acc = self._by_team_size.get(key)
        if acc is None:
            acc = self._by_team_size[key] = [0.0, 0.0]
        acc[0] += duration_s
        acc[1] += 1
        acc = self._by_size.get(job.slots)
        if acc is None:
            acc = self._by_size[job.slots] = [0.0, 0.0]
        acc[0] += duration_s
        acc[1] += 1
        acc = self._all
        acc[0] += duration_s
        acc[1] += 1
        memo = self._memo
        memo.pop(key, None)
        for k in self._from_size.pop(job.slots, ()):
            memo.pop(k, None)
        if self._from_all:
            for k in self._from_all:
                memo.pop(k, None)
            self._from_all.clear()

    def predict(self, job: Job) -> float | None:
        if job.est_duration_s is not None:
            return job.est_duration_s
        key = (job.team, job.slots)
        memo = self._memo
        if key in memo:
            return memo[key]
        p: float | None = None
        acc = self._by_team_size.get(key)
        if acc and acc[1]:
            p = acc[0] / acc[1]
        else:
            acc = self._by_size.get(job.slots)
            if acc and acc[1]:
                p = acc[0] / acc[1]
                self._from_size.setdefault(job.slots, set()).add(key)
            else:
                acc = self._all
                p = acc[0] / acc[1] if acc[1] else None
                self._from_all.add(key)
        memo[key] = p
        return p


def predicted_remaining(job: Job, predict: Predictor) -> float | None:
    """Predicted seconds of work left: the prediction less the durable work of earlier attempts."""
    p = predict(job)
    return None if p is None else max(p - job.done_s, 0.0)
