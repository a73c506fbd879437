"""StageResult and GateDecision: plain data every stage ends in and every gate reads."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from traingate.job.vocab import Status
from traingate.units import usd

NEXT_STAGE = {"unit": "smoke", "smoke": "canary", "canary": "full"}
# The step profile a training stage's metrics carry (ladder.outcomes reads them from the trainer's result).
# Kept here, torch-free, so the Slurm batch step that reports them does not import what preflight checks with.
PROFILE_METRICS = (
    "step_time_mean_s",
    "step_time_p50_s",
    "step_time_p90_s",
    "step_time_p99_s",
    "samples_per_s",
    "tokens_per_s",
    "peak_memory_mb",
    "startup_s",
    "data_wait_fraction",
)


@dataclass
class StageResult:
    stage: str
    status: Status
    metrics: dict[str, float] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)  # named pass/fail facts, all must hold
    cost_usd: float = 0.0
    duration_s: float = 0.0
    checkpoint_uri: str | None = None
    estimate: dict[str, float] = field(default_factory=dict)  # sizing estimate of the next stage
    details: dict[str, Any] = field(default_factory=dict)  # profile, eval outputs, command, log tail
    error: str | None = None
    # Every attempt as charged (traingate.cost.ledger.Attempt.to_record): pool, slots, price, start, end,
    # held and backoff seconds, idle, outcome, dollars. Training stages only; the ledger reads these.
    attempts: list[dict[str, Any]] = field(default_factory=list)
    estimated_cost_usd: float | None = None  # what the stage before estimated this one would cost

    def __post_init__(self) -> None:
        self.status = Status(self.status)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageResult:
        return cls(**d)

    def numeric_metrics(self) -> dict[str, float]:
        return {
            k: float(v)
            for k, v in self.metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
        }


@dataclass
class GateDecision:
    stage: str
    passed: bool
    reasons: list[str]  # why it failed (empty when passed)
    evaluated: list[tuple[str, str, bool]] = field(default_factory=list)  # (rule, measured, ok)

    def summary(self) -> str:
        if self.passed:
            return f"gate after {self.stage}: passed ({len(self.evaluated)} rules)"
        return f"gate after {self.stage}: FAILED: " + "; ".join(self.reasons)


def render_markdown(result: StageResult, decision: GateDecision | None) -> str:
    """The stage report shown as a Prefect artifact and stored in MLflow."""
    lines = [
        f"# Stage `{result.stage}`: {result.status}",
        "",
        f"duration {result.duration_s:.1f} s, cost {usd(result.cost_usd)}"
        + (
            f" (estimated {usd(result.estimated_cost_usd)} by the stage before)"
            if result.estimated_cost_usd is not None
            else ""
        )
        + (f", checkpoint `{result.checkpoint_uri}`" if result.checkpoint_uri else ""),
        "",
    ]
    if result.error:
        lines += [f"**error:** {result.error}", ""]
    lines += ["| metric | value |", "|---|---|"]
    for k, v in sorted(result.metrics.items()):
        if isinstance(v, (int, float)):
            lines.append(f"| {k} | {v:.6g} |")
    if result.checks:
        lines += ["", "| check | ok |", "|---|---|"]
        lines += [f"| {k} | {'yes' if ok else '**no**'} |" for k, ok in sorted(result.checks.items())]
    if result.estimate:
        lines += ["", "| estimate (next stage) | value |", "|---|---|"]
        lines += [f"| {k} | {v:.6g} |" for k, v in sorted(result.estimate.items())]
    if decision is not None:
        lines += [
            "",
            f"## Gate: {'passed' if decision.passed else 'FAILED'}",
            "",
            "| rule | measured | ok |",
            "|---|---|---|",
        ]
        lines += [f"| {r} | {m} | {'yes' if ok else '**no**'} |" for r, m, ok in decision.evaluated]
        if decision.reasons:
            lines += ["", *[f"- {r}" for r in decision.reasons]]
    return "\n".join(lines) + "\n"


def dumps(result: StageResult) -> str:
    return json.dumps(result.to_dict(), indent=1, sort_keys=True, default=str)
