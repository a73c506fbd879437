"""The cost ledger: slot-hours and dollars per attempt, and what they add up to. Pure arithmetic.

An attempt holds its slots from its launch to its end and through the backoff that follows it
(the gang keeps them while the supervisor waits to relaunch), so it is charged
``(end - start + backoff_s) / 3600 x slots x price``. Of that:

- **lost to failures**: the whole charge of an attempt that did not complete (failed or
  preempted), plus every backoff. An upper bound: work an attempt checkpointed before it failed
  is counted as lost, because the ledger does not know how much of it the next attempt kept.
- **idle**: ``idle_s`` of the attempt (slots held, no training step running: start-up before the
  first step, or all of an attempt that never trained). Idle and lost overlap for a failed attempt.

Cost per successful run of an experiment family: everything the family's runs spent, failed runs
included, divided by the runs that succeeded -- the waste a throughput number hides.

>>> a = Attempt("r1", "full", 0, "gpu-a100", slots=8, price_per_slot_hour=2.5, start=0, end=1800,
...             outcome=Outcome.FAILED, backoff_s=60, idle_s=120)
>>> c = charge(a)
>>> round(c.slot_hours, 3), round(c.usd, 2), round(c.lost_usd, 2), round(c.idle_usd, 2)
(4.133, 10.33, 10.33, 0.67)
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from traingate.job.vocab import Cause
from traingate.units import usd


class Outcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    PREEMPTED = "preempted"


@dataclass(frozen=True)
class Attempt:
    run_id: str  # the traingate run (pipeline) the attempt belongs to
    stage: str
    number: int  # 0-based, within the stage
    pool: str
    slots: int
    price_per_slot_hour: float
    start: float  # epoch seconds
    end: float
    outcome: Outcome
    backoff_s: float = 0.0  # waited after this attempt before the next launch (slots held)
    idle_s: float = 0.0  # slots held while no step ran (within start..end)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcome", Outcome(self.outcome))
        problems = [
            f"slots = {self.slots}: needs >= 1" if self.slots < 1 else "",
            f"price_per_slot_hour = {self.price_per_slot_hour}: needs a finite value >= 0"
            if not (math.isfinite(self.price_per_slot_hour) and self.price_per_slot_hour >= 0)
            else "",
            f"end = {self.end:g} is before start = {self.start:g}" if self.end < self.start else "",
            f"backoff_s = {self.backoff_s:g}: needs >= 0" if self.backoff_s < 0 else "",
            f"idle_s = {self.idle_s:g}: needs 0 .. end - start ({self.end - self.start:g})"
            if self.end >= self.start and not 0 <= self.idle_s <= self.end - self.start + 1e-9
            else "",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError(f"attempt {self.number} of {self.run_id}/{self.stage}: " + "; ".join(problems))

    @property
    def held_s(self) -> float:
        return self.end - self.start + self.backoff_s

    def to_record(self) -> dict[str, Any]:
        """The attempt as a StageResult records it: what it held and what that cost (``usd``)."""
        return {
            "stage": self.stage,
            "number": self.number,
            "pool": self.pool,
            "slots": self.slots,
            "price_per_slot_hour": self.price_per_slot_hour,
            "start": self.start,
            "end": self.end,
            "held_s": self.held_s,
            "backoff_s": self.backoff_s,
            "idle_s": self.idle_s,
            "outcome": str(self.outcome),
            "usd": charge(self).usd,
        }

    @classmethod
    def from_record(cls, run_id: str, r: dict[str, Any]) -> Attempt:
        """The reverse of :meth:`to_record`; ``held_s`` and ``usd`` are derived, so not read back."""
        return cls(
            run_id,
            r["stage"],
            int(r["number"]),
            r["pool"],
            int(r["slots"]),
            float(r["price_per_slot_hour"]),
            float(r["start"]),
            float(r["end"]),
            Outcome(r["outcome"]),
            backoff_s=float(r["backoff_s"]),
            idle_s=float(r["idle_s"]),
        )


def attempts_of(
    run_id: str, stage: str, supervised: Sequence[dict[str, Any]], pool: str, slots: int, price_per_slot_hour: float
) -> list[Attempt]:
    """The ledger's attempts from the supervisor's (``asdict`` of its Attempt, in launch order), numbered
    0.. across the stage: one stage may span several supervisions (smoke's stop-and-resume, a resume).

    Idle is the time from launch to the attempt's first completed step (imports, rendezvous,
    checkpoint load), or all of an attempt that never completed a step.
    """
    out = []
    for n, a in enumerate(supervised):
        start = float(a["launched_at"])
        end = float(a["ended_at"]) if a.get("ended_at") is not None else start
        first = a.get("first_step_time")
        idle = min(max(0.0, (float(first) if first is not None else end) - start), end - start)
        cause = a.get("cause")
        outcome = (
            Outcome.COMPLETED if cause is None else Outcome.PREEMPTED if cause == Cause.PREEMPTED else Outcome.FAILED
        )
        out.append(
            Attempt(
                run_id,
                stage,
                n,
                pool,
                slots,
                price_per_slot_hour,
                start,
                end,
                outcome,
                backoff_s=float(a.get("backoff_s") or 0.0),
                idle_s=idle,
            )
        )
    return out


@dataclass(frozen=True)
class Charge:
    attempt: Attempt
    slot_hours: float
    usd: float
    lost_slot_hours: float
    lost_usd: float
    idle_slot_hours: float
    idle_usd: float


def charge(a: Attempt) -> Charge:
    """What one attempt cost, and how much of it was lost and idle."""
    rate = a.price_per_slot_hour
    slot_h = a.held_s / 3600.0 * a.slots
    lost_s = a.held_s if a.outcome != Outcome.COMPLETED else a.backoff_s
    lost_h = lost_s / 3600.0 * a.slots
    idle_h = a.idle_s / 3600.0 * a.slots
    return Charge(a, slot_h, slot_h * rate, lost_h, lost_h * rate, idle_h, idle_h * rate)


def total_usd(attempts: Iterable[Attempt]) -> float:
    """What attempts cost together: the one sum behind a stage's ``cost_usd`` (and so MLflow's ``stage.cost_usd``,
    `traingate runs` and `show`), `traingate cost` and `traingate watch` (:mod:`traingate.cost.charged`)."""
    return sum(charge(a).usd for a in attempts)


@dataclass
class Totals:
    attempts: int = 0
    unfinished_attempts: int = 0  # failed or preempted
    slot_hours: float = 0.0
    usd: float = 0.0
    lost_slot_hours: float = 0.0
    lost_usd: float = 0.0
    idle_slot_hours: float = 0.0
    idle_usd: float = 0.0

    def add(self, c: Charge) -> None:
        self.attempts += 1
        self.unfinished_attempts += c.attempt.outcome != Outcome.COMPLETED
        self.slot_hours += c.slot_hours
        self.usd += c.usd
        self.lost_slot_hours += c.lost_slot_hours
        self.lost_usd += c.lost_usd
        self.idle_slot_hours += c.idle_slot_hours
        self.idle_usd += c.idle_usd

    @property
    def idle_share(self) -> float:
        return self.idle_slot_hours / self.slot_hours if self.slot_hours else 0.0

    @property
    def lost_share(self) -> float:
        return self.lost_slot_hours / self.slot_hours if self.slot_hours else 0.0


@dataclass(frozen=True)
class Run:
    """One traingate run (a climb of the ladder) and whether it succeeded."""

    run_id: str
    experiment: str  # its family: runs of one experiment try to produce the same model
    team: str
    succeeded: bool
    attempts: tuple[Attempt, ...] = ()
    estimates: dict[str, float] = field(default_factory=dict)  # stage -> the stage before's estimate of its cost
    # processes -> a stage's measured profile at that many (smoke runs 1, canary one node): scaling advice
    profiles: dict[int, dict[str, float]] = field(default_factory=dict)
    price_per_slot_hour: float = 0.0


@dataclass
class Family:
    experiment: str
    runs: int = 0
    successful_runs: int = 0
    totals: Totals = field(default_factory=Totals)
    # Over the runs whose full stage ran and had the canary's estimate: estimated vs charged.
    full_estimated_usd: float = 0.0
    full_actual_usd: float = 0.0
    full_estimated_runs: int = 0

    @property
    def cost_per_successful_run(self) -> float | None:
        """None when no run succeeded: the money bought nothing yet."""
        return self.totals.usd / self.successful_runs if self.successful_runs else None


@dataclass
class Report:
    charges: list[Charge]
    total: Totals
    by_team: dict[str, Totals]
    families: dict[str, Family]


def report(runs: Iterable[Run]) -> Report:
    """Charge every attempt of every run and add them up: overall, per team, per experiment family."""
    charges: list[Charge] = []
    total = Totals()
    teams: dict[str, Totals] = defaultdict(Totals)
    families: dict[str, Family] = {}
    for run in runs:
        fam = families.setdefault(run.experiment, Family(run.experiment))
        fam.runs += 1
        fam.successful_runs += run.succeeded
        full_usd = 0.0
        for a in run.attempts:
            c = charge(a)
            charges.append(c)
            full_usd += c.usd if a.stage == "full" else 0.0
            for t in (total, teams[run.team], fam.totals):
                t.add(c)
        if "full" in run.estimates and any(a.stage == "full" for a in run.attempts):
            fam.full_estimated_usd += run.estimates["full"]
            fam.full_actual_usd += full_usd
            fam.full_estimated_runs += 1
    return Report(charges, total, dict(sorted(teams.items())), dict(sorted(families.items())))


def _usd(v: float | None) -> str:
    return "-" if v is None else usd(v)


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _estimate_vs_actual(f: Family) -> str:
    if not f.full_estimated_runs:
        return "-"
    ratio = f" (x{f.full_actual_usd / f.full_estimated_usd:.2f})" if f.full_estimated_usd else ""
    return f"{_usd(f.full_estimated_usd)} / {_usd(f.full_actual_usd)}{ratio}"


def render(r: Report, title: str = "cost") -> str:
    """The report as text: totals, per team, per experiment family (markdown tables)."""
    t = r.total
    lines = [
        f"# {title}",
        "",
        f"{t.attempts} attempts ({t.unfinished_attempts} failed or preempted), {t.slot_hours:.4f} slot-hours, "
        f"{_usd(t.usd)}; lost to failures and backoff {_usd(t.lost_usd)} ({_pct(t.lost_share)}); "
        f"idle {_usd(t.idle_usd)} ({_pct(t.idle_share)})",
        "",
    ]

    def rows(header: str, items: Sequence[tuple[str, Totals, list[str]]], extra: list[str]) -> list[str]:
        cols = [header, "attempts", "slot-hours", "spend", "lost", "lost share", "idle share", *extra]
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for name, x, more in items:
            out.append(
                "| "
                + " | ".join(
                    [
                        name,
                        str(x.attempts),
                        f"{x.slot_hours:.4f}",
                        _usd(x.usd),
                        _usd(x.lost_usd),
                        _pct(x.lost_share),
                        _pct(x.idle_share),
                        *more,
                    ]
                )
                + " |"
            )
        return out + [""]

    lines += rows("team", [(k, v, []) for k, v in r.by_team.items()], [])
    lines += rows(
        "experiment",
        [
            (k, f.totals, [f"{f.successful_runs}/{f.runs}", _usd(f.cost_per_successful_run), _estimate_vs_actual(f)])
            for k, f in r.families.items()
        ],
        ["succeeded", "cost per successful run", "full: canary estimate / actual"],
    )
    return "\n".join(lines)
