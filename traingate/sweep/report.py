"""Trial outcomes -> objective values; reporting a running trial's progress to Optuna."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna

from traingate.job.vocab import Status
from traingate.sweepspec import SweepSpec

EXTRA_METRICS = ("cost_usd", "duration_s", "steps")


@dataclass
class TrialOutcome:
    state: Status  # completed | pruned | failed
    values: list[float] | None = None
    steps: int = 0
    cost_usd: float = 0.0
    start_ts: float = 0.0  # when the trial held its slots and started training
    end_ts: float = 0.0
    pid: int | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    pruned_at_step: int | None = None
    resumed_from_step: int = 0
    restarts: int = 0  # the supervisor's restarts of the trial's process tree

    def __post_init__(self) -> None:
        self.state = Status(self.state)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def objective_values(sweep: SweepSpec, metrics: dict[str, float]) -> list[float]:
    """The objective vector of a finished trial, in the spec's order. Raises ValueError naming what is missing."""
    out = []
    for o in sweep.objectives:
        v = metrics.get(o.metric)
        if v is None or not math.isfinite(float(v)):
            raise ValueError(
                f"objective metric {o.metric!r} missing or not finite in the trial's results "
                f"(have {sorted(metrics)}); fix sweep.objectives"
            )
        out.append(float(v))
    return out


class Reporter:
    """Feeds intermediate values to ``trial.report`` and answers whether the scheduler prunes the trial."""

    def __init__(self, trial: optuna.Trial, sweep: SweepSpec):
        self.trial = trial
        self.metric = sweep.objectives[0].metric
        self.enabled = len(sweep.objectives) == 1  # Optuna cannot prune multi-objective trials
        self.last_step = -1
        self.pruned_at: int | None = None
        self.history: list[tuple[int, float]] = []

    def feed(self, rec: dict[str, Any]) -> bool:
        if self.pruned_at is not None:
            return True  # the trial is over for the scheduler; later lines are the process winding down
        step = int(rec["step"])
        if not self.enabled or step <= self.last_step or self.metric not in rec:
            return False
        value = float(rec[self.metric])
        self.trial.report(value, step)
        self.history.append((step, value))
        self.last_step = step
        if self.pruned_at is None and self.trial.should_prune():
            self.pruned_at = step
        return self.pruned_at is not None
