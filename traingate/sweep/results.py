"""What a finished sweep yields: the ranking, the winner, the reproducibility verdict. Plain functions."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from traingate.sweepspec import SweepSpec


def ranked(study: optuna.Study, sweep: SweepSpec) -> list[FrozenTrial]:
    """Complete trials, best first. Multi-objective: the Pareto front first, each part by the first objective."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    sign = 1.0 if sweep.objectives[0].direction == "minimize" else -1.0
    front = {t.number for t in study.best_trials} if len(sweep.objectives) > 1 and complete else set()
    return sorted(complete, key=lambda t: (t.number not in front, sign * t.values[0], t.number))


def sweep_seeds(base_seed: int, n: int) -> list[int]:
    """New seeds for re-runs: disjoint from the sweep's own seed."""
    return [base_seed + 1000 * (i + 1) for i in range(n)]


@dataclass
class Reproduction:
    trial_number: int
    params: dict[str, Any]
    sweep_value: float
    rerun_values: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rerun_values) if self.rerun_values else float("nan")


@dataclass
class Verdict:
    passed: bool
    winner: int  # trial number promoted
    reasons: list[str]


def reproducibility(reps: list[Reproduction], sweep: SweepSpec) -> Verdict:
    """Pick the configuration with the best mean over new seeds; it must land within tolerance of its sweep value.

    >>> from traingate.sweepspec import SweepSpec
    >>> sw = SweepSpec.model_validate({"space": {"x": {"type": "float", "low": 0, "high": 1}},
    ...                                "promotion": {"top_k": 2, "tolerance": 0.01}})
    >>> reproducibility([Reproduction(0, {}, 0.95, [0.90, 0.91]), Reproduction(1, {}, 0.93, [0.93, 0.925])], sw).winner
    1
    """
    assert reps, "needs at least one re-run configuration"
    sign = 1.0 if sweep.objectives[0].direction == "minimize" else -1.0
    best = min(reps, key=lambda r: sign * r.mean)
    gap = abs(best.mean - best.sweep_value)
    tol = sweep.promotion.tolerance
    reasons = (
        []
        if gap <= tol
        else [
            f"trial {best.trial_number}: mean {sweep.objectives[0].metric} over {len(best.rerun_values)} new seeds "
            f"{best.mean:.4f} differs from its sweep value {best.sweep_value:.4f} by {gap:.4f} > tolerance {tol}"
        ]
    )
    return Verdict(passed=not reasons, winner=best.trial_number, reasons=reasons)
