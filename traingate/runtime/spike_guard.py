"""Rank 0's own loss-spike test, at every step.

The supervisor evaluates the alert rules about once a second (``alerts.every_s``) from metrics.jsonl:
on 10 ms steps that is a hundred steps after a spike, trained from a blown-up state, while checkpoint
retention may prune the last checkpoint before it. So rank 0 applies the same test
(:func:`traingate.alerts.rules.spike_of`, the same ``alerts.loss_spike`` spec) to each step's loss as it
happens. When it fires and its action acts on the training state (roll back, pause, stop), rank 0 pins
the newest checkpoint before the spike against retention (the roll-back's target), flushes
metrics.jsonl and holds (heartbeat phase ``holding``, which makes the supervisor evaluate at its next
tick): it waits, and its peers with it at their next collective, until the supervisor acts (SIGKILL for
a roll-back, SIGTERM for a pause or stop) or, when none comes within ``HOLD_S``, goes on. The decision
stays the supervisor's; rank 0 only keeps it from coming late.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable

from traingate.alerts.rules import Action, AlertsSpec, spike_of
from traingate.job.files import StepMetrics

log = logging.getLogger(__name__)

_ACTS_ON_STATE = frozenset({Action.ROLLBACK, Action.PAUSE, Action.STOP})
HOLD_S = 5.0


class SpikeGuard:
    def __init__(
        self,
        alerts: AlertsSpec,
        pin_before: Callable[[int], int | None],
        flush: Callable[[], None],
        stopping: Callable[[], bool],
    ):
        self.spec = alerts.loss_spike
        self.armed = alerts.enabled and self.spec.enabled and self.spec.action in _ACTS_ON_STATE
        # The supervisor evaluates at its next tick (0.2 s) when rank 0 holds; the limit is for a supervisor
        # that does not agree (its rule already raised this event) or is slow to read the flushed lines.
        self.hold_s = HOLD_S
        self.head: list[float] = []  # the stage's first min_points losses: the start level
        self.steps: deque[int] = deque(maxlen=self.spec.window + self.spec.steps)
        self.recent: deque[float] = deque(maxlen=self.spec.window + self.spec.steps)
        self.quiet = 0  # points left before another firing counts: the supervisor raises one per window
        self.pin_before, self.flush, self.stopping = pin_before, flush, stopping

    def seed(self, earlier: list[StepMetrics], upto: int) -> None:
        """A relaunch resumed at step ``upto``: the baseline is the losses rank 0 wrote up to there (the
        newest line per step: a rolled-back attempt's later steps are not part of the run), not nothing."""
        by_step = {m.step: m.loss for m in earlier if m.step <= upto}
        for step, v in sorted(by_step.items()):
            self._add(step, v)

    def _add(self, step: int, loss: float) -> None:
        if not math.isfinite(loss):
            return
        if len(self.head) < self.spec.min_points:
            self.head.append(loss)
        self.steps.append(step)
        self.recent.append(loss)

    def observe(self, step: int, loss: float) -> bool:
        """Test the loss of ``step``; True when it made a spike and rank 0 held for the supervisor."""
        if not self.armed or not math.isfinite(loss):
            return False
        self._add(step, loss)
        if self.quiet:
            self.quiet -= 1
            return False
        found = spike_of(self.head, list(self.recent), self.spec)
        if found is None:
            return False
        self.quiet = self.spec.window
        began = self.steps[found.first]
        pinned = self.pin_before(began)
        self.flush()
        log.warning(
            "loss spike from step %d (median %.4g over the latest %d steps, %.1fx the median %.4g before): "
            "checkpoint %s kept for a roll-back; waiting up to %.0f s for the supervisor to act",
            began,
            found.level,
            self.spec.steps,
            found.ratio,
            found.median,
            pinned if pinned is not None else "(none before it)",
            self.hold_s,
        )
        end = time.monotonic() + self.hold_s
        while time.monotonic() < end and not self.stopping():
            time.sleep(0.02)
        return True
