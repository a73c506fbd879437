"""Budgets per run, per sweep and per team per period: what is left of each, and the gate's refusal.

Spend is the ledger's: every recorded attempt's slot-hours x price, restarts, backoff and idle
included (:mod:`traingate.cost.ledger`). A team's period is a calendar day, week (from Monday) or
month in UTC; an attempt that straddles the period's start counts with the part of its held time
inside the period. A sweep's spend is what its trials recorded (they record a total, not attempts).

The gate before a stage refuses it when the previous stage's estimate of its cost exceeds what is
left of any budget that applies (:func:`refusals`, used by :func:`traingate.ladder.gates.decide`).

>>> from traingate.cost.ledger import Attempt, Run
>>> a = Attempt("r1", "canary", 0, "gpu-a100", 4, 2.5, start=0, end=3600, outcome="completed")
>>> [b] = budget_left(run_id="r1", team="vision", runs=[Run("r1", "e", "vision", False, (a,))],
...                   max_run_usd=50.0, now=3600)
>>> b.scope, b.spent_usd, b.left_usd
(<Scope.RUN: 'run'>, 10.0, 40.0)
>>> refusals(45.0, "full", [b])  # doctest: +NORMALIZE_WHITESPACE
['estimated cost of full $45 exceeds what is left of the run budget of r1: $40 ($10 of $50 spent); raise
budget.max_run_usd (traingate resume RUN_ID --set budget.max_run_usd=...) or lower stages.full.max_steps']
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from traingate.capacity.pools import Period, TeamBudget
from traingate.cost.ledger import Attempt, Run, charge


class Scope(StrEnum):
    RUN = "run"
    SWEEP = "sweep"
    TEAM = "team"


@dataclass(frozen=True)
class BudgetLeft:
    scope: Scope
    name: str  # the run id, the sweep's study, the team
    limit_usd: float
    spent_usd: float
    fix: str  # how to raise it
    period: str = ""  # a team budget's: "week from 2026-09-14 (UTC)"

    @property
    def left_usd(self) -> float:
        return max(0.0, self.limit_usd - self.spent_usd)

    @property
    def label(self) -> str:
        what = f"{self.scope} budget of {self.name}"
        return f"{what} for the {self.period}" if self.period else what


def period_start(period: Period, now: float) -> float:
    """Epoch seconds of the start of the calendar ``period`` (UTC) that contains ``now``.

    >>> t = dt.datetime(2026, 9, 17, 15, 30, tzinfo=dt.timezone.utc).timestamp()  # a Thursday
    >>> [dt.datetime.fromtimestamp(period_start(p, t), dt.timezone.utc).date().isoformat() for p in Period]
    ['2026-09-17', '2026-09-14', '2026-09-01']
    """
    d = dt.datetime.fromtimestamp(now, dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == Period.WEEK:
        d -= dt.timedelta(days=d.weekday())
    elif period == Period.MONTH:
        d = d.replace(day=1)
    return d.timestamp()


def spent_between(attempts: Iterable[Attempt], since: float, until: float) -> float:
    """Dollars of the attempts' held time (launch .. end + backoff) that falls within ``since .. until``."""
    usd = 0.0
    for a in attempts:
        held_end = a.end + a.backoff_s
        inside = max(0.0, min(held_end, until) - max(a.start, since))
        if inside and a.held_s:
            usd += charge(a).usd * inside / a.held_s
    return usd


def budget_left(
    *,
    run_id: str,
    team: str,
    runs: Iterable[Run],
    now: float,
    max_run_usd: float | None = None,
    team_budgets: Mapping[str, TeamBudget] | None = None,
    sweep: str | None = None,
    max_sweep_usd: float | None = None,
    sweep_spent_usd: float = 0.0,
) -> list[BudgetLeft]:
    """What is left of each budget that applies to a stage of ``run_id`` (of ``team``), from the recorded
    ``runs`` (every run of the team when a team budget applies; the run itself otherwise).

    Run: ``budget.max_run_usd`` against the run's attempts. Sweep (a trial's stage): the sweep's
    ``budget.max_cost_usd`` against what its trials spent. Team: ``team_budgets[team]`` (the pools config)
    against the team's attempts within the current period. Budgets not set are left out.
    """
    runs = list(runs)
    out: list[BudgetLeft] = []
    if max_run_usd is not None:
        mine = [a for r in runs if r.run_id == run_id for a in r.attempts]
        out.append(
            BudgetLeft(
                Scope.RUN,
                run_id,
                max_run_usd,
                sum(charge(a).usd for a in mine),
                "raise budget.max_run_usd (traingate resume RUN_ID --set budget.max_run_usd=...)",
            )
        )
    if sweep is not None and max_sweep_usd is not None:
        out.append(
            BudgetLeft(
                Scope.SWEEP,
                sweep,
                max_sweep_usd,
                sweep_spent_usd,
                "raise sweep.budget.max_cost_usd in the sweep's spec",
            )
        )
    tb = (team_budgets or {}).get(team)
    if tb is not None:
        since = period_start(tb.period, now)
        attempts = [a for r in runs if r.team == team for a in r.attempts]
        day = dt.datetime.fromtimestamp(since, dt.UTC).date().isoformat()
        out.append(
            BudgetLeft(
                Scope.TEAM,
                team,
                tb.budget_usd,
                spent_between(attempts, since, now),
                f"raise team_budgets.{team}.budget_usd in the pools config, or wait for the next {tb.period}",
                period=f"{tb.period} from {day} (UTC)",
            )
        )
    return out


def _usd(v: float) -> str:
    return f"${v:.6g}"


def refusals(estimate_usd: float, stage: str, budgets: Sequence[BudgetLeft]) -> list[str]:
    """One line per budget the estimate of ``stage`` does not fit in: the scope, the numbers, the fix."""
    knob = f"stages.{stage}.max_steps"
    return [
        f"estimated cost of {stage} {_usd(estimate_usd)} exceeds what is left of the {b.label}: "
        f"{_usd(b.left_usd)} ({_usd(b.spent_usd)} of {_usd(b.limit_usd)} spent); {b.fix} or lower {knob}"
        for b in budgets
        if estimate_usd > b.left_usd
    ]


def tightest(budgets: Sequence[BudgetLeft]) -> BudgetLeft | None:
    """The budget with the least left: the one a running stage pauses at first."""
    return min(budgets, key=lambda b: b.left_usd, default=None)
