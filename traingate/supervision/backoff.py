"""Exponential backoff with jitter, and the retry budget of one run.

>>> b = Backoff(base_s=1.0, factor=2.0, max_s=30.0, jitter=0.0)
>>> [b.delay(n) for n in range(6)]
[1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
>>> budget = RetryBudget(max_restarts=2, max_downtime_s=60.0)
>>> budget.charge(5.0); budget.charge(5.0); budget.allows()
False
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backoff:
    base_s: float = 1.0
    factor: float = 2.0
    max_s: float = 60.0
    jitter: float = 0.5  # fraction of the delay drawn at random, so restarted jobs do not stampede together

    def delay(self, restart: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before restart number ``restart`` (0-based)."""
        d = min(self.max_s, self.base_s * self.factor**restart)
        if self.jitter:
            d *= 1.0 - self.jitter * (rng or random).random()
        return d


@dataclass
class RetryBudget:
    """A run may restart at most ``max_restarts`` times and lose at most ``max_downtime_s`` to faults.

    Downtime charged per restart is the failed launch's wall-clock plus the backoff before
    the next one: the count stops a fast crash loop, the clock stops a slow one.
    """

    max_restarts: int
    max_downtime_s: float
    restarts: int = 0
    downtime_s: float = 0.0
    history: list[float] = field(default_factory=list)

    def charge(self, downtime_s: float) -> None:
        self.restarts += 1
        self.downtime_s += downtime_s
        self.history.append(downtime_s)

    def allows(self, next_downtime_s: float = 0.0) -> bool:
        return self.restarts < self.max_restarts and self.downtime_s + next_downtime_s <= self.max_downtime_s

    def why_not(self, next_downtime_s: float = 0.0) -> str:
        if self.restarts >= self.max_restarts:
            return f"retry budget spent: {self.restarts} restarts (supervision.max_restarts = {self.max_restarts})"
        return (
            f"retry budget spent: {self.downtime_s + next_downtime_s:.0f} s lost to faults "
            f"(supervision.max_downtime_s = {self.max_downtime_s:.0f})"
        )
