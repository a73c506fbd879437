"""Promotion gates: pure functions of a StageResult.

>>> from traingate.spec import GateSpec, GateRule
>>> r = StageResult("canary", "completed", metrics={"loss_decrease_fraction": 0.02})
>>> d = decide(r, GateSpec(rules=[GateRule(metric="loss_decrease_fraction", op=">=", value=0.1)]))
>>> d.passed, d.reasons
(False, ['loss_decrease_fraction = 0.02, required >= 0.1'])
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from traingate.cost.budget import BudgetLeft, refusals
from traingate.job.result import NEXT_STAGE, GateDecision, StageResult
from traingate.spec import GateSpec

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne}


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def decide(
    result: StageResult, gate: GateSpec, max_cost_usd: float | None = None, budgets: Sequence[BudgetLeft] = ()
) -> GateDecision:
    """Pass only if the stage completed, all its checks hold, every rule holds, and the
    estimated cost of the next stage (if the stage estimated one) fits ``budget.max_cost_usd`` and
    what is left of each budget in ``budgets`` (run, sweep, team: :func:`traingate.cost.budget.budget_left`)."""
    reasons: list[str] = []
    evaluated: list[tuple[str, str, bool]] = []
    completed = result.status == "completed"
    evaluated.append(("status == completed", result.status, completed))
    if not completed:
        reasons.append(f"stage ended {result.status}" + (f": {result.error}" if result.error else ""))
    for name, ok in sorted(result.checks.items()):
        evaluated.append((f"check {name}", "ok" if ok else "failed", ok))
        if not ok:
            reasons.append(f"check {name} failed")
    for rule in gate.rules:
        text = f"{rule.metric} {rule.op} {_fmt(rule.value)}"
        value = result.metrics.get(rule.metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            evaluated.append((text, "not measured", False))
            reasons.append(f"{rule.metric} was not measured (rule: {text})")
            continue
        ok = math.isfinite(value) and _OPS[rule.op](value, rule.value)
        evaluated.append((text, _fmt(value), ok))
        if not ok:
            reasons.append(f"{rule.metric} = {_fmt(value)}, required {rule.op} {_fmt(rule.value)}")
    est = result.estimate.get("next_stage_cost_usd")
    if max_cost_usd is not None and est is not None:
        ok = est <= max_cost_usd
        evaluated.append((f"estimated next-stage cost <= ${_fmt(max_cost_usd)}", f"${_fmt(est)}", ok))
        if not ok:
            reasons.append(
                f"estimated cost of the next stage ${_fmt(est)} exceeds budget.max_cost_usd ${_fmt(max_cost_usd)}"
            )
    if est is not None:
        nxt = NEXT_STAGE.get(result.stage, "the next stage")
        for b in budgets:
            ok = est <= b.left_usd
            evaluated.append(
                (
                    f"estimated {nxt} cost <= what is left of the {b.label}",
                    f"${_fmt(est)} vs ${_fmt(b.left_usd)} left",
                    ok,
                )
            )
        reasons += refusals(est, nxt, budgets)
    return GateDecision(result.stage, not reasons, reasons, evaluated)


def over_budget_only(result: StageResult, gate: GateSpec, decision: GateDecision) -> bool:
    """``decision`` refused the next stage on its cost alone: ``result``'s stage completed and holds every check and
    rule of ``gate``, and only the estimate of the next stage exceeds a budget, which a larger budget (or a smaller
    next stage) fixes; a run started from the Prefect UI pauses for one instead of ending.

    >>> from traingate.spec import GateSpec
    >>> r = StageResult("canary", "completed", estimate={"next_stage_cost_usd": 5.0})
    >>> over_budget_only(r, GateSpec(), decide(r, GateSpec(), max_cost_usd=1.0))
    True
    >>> failed = StageResult("canary", "failed", estimate={"next_stage_cost_usd": 5.0})
    >>> over_budget_only(failed, GateSpec(), decide(failed, GateSpec(), max_cost_usd=1.0))
    False
    """
    return not decision.passed and decide(result, gate).passed
