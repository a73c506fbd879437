"""The pieces a budget-gate pause is made of, without a server: which refusals a new budget can fix, the estimate
made again under a resumed spec, and the Resume form's budgets turned into `--set` overrides."""
from __future__ import annotations

import pytest

from traingate.job.result import StageResult
from traingate.ladder.gates import decide, over_budget_only
from traingate.ladder.outcomes import _estimate_next, reestimated
from traingate.spec import GateRule, GateSpec, apply_overrides, load_spec, parse_spec

PACE = {"step_time_mean_s": 0.5, "startup_s": 0.0}


def _canary(spec) -> StageResult:
    return StageResult("canary", "completed", metrics={"loss_decrease_fraction": 0.5}, details={"profile": PACE},
                       estimate=_estimate_next(spec, "canary", PACE))


def test_a_refusal_on_the_estimate_alone_is_what_a_new_budget_fixes_and_a_broken_rule_is_not(tiny_spec):
    spec = load_spec(tiny_spec())
    canary = _canary(spec)
    rule = GateSpec(rules=[GateRule(metric="loss_decrease_fraction", op=">=", value=0.1)])
    over = decide(canary, rule, max_cost_usd=1e-9)
    assert over_budget_only(canary, rule, over)
    strict = GateSpec(rules=[GateRule(metric="loss_decrease_fraction", op=">=", value=0.9)])
    assert not over_budget_only(canary, strict, decide(canary, strict, max_cost_usd=1e-9))
    assert not over_budget_only(canary, rule, decide(canary, rule, max_cost_usd=100.0))  # passed: nothing to fix


def test_fewer_steps_of_the_next_stage_given_on_resume_shrink_the_estimate_the_gate_compares(tiny_spec):
    spec = load_spec(tiny_spec(), ["stages.full.max_steps=1000"])
    canary = _canary(spec)
    fewer = parse_spec(apply_overrides(spec.to_dict(), ["stages.full.max_steps=100"]))
    again = reestimated(canary, fewer)
    assert again.estimate["next_stage_cost_usd"] * 10 == pytest.approx(canary.estimate["next_stage_cost_usd"])
    assert again.metrics == canary.metrics and canary.estimate == _estimate_next(spec, "canary", PACE)
    nothing = StageResult("canary", "failed")
    assert reestimated(nothing, fewer) is nothing  # a stage that estimated nothing is left alone


def test_the_budget_form_starts_at_the_runs_budgets_keeps_its_fields_bounds_and_asks_for_what_was_given():
    from flows.pipeline import BudgetResume

    form = BudgetResume.starting_at("the estimate is $5", max_run_usd=2.0, max_cost_usd=None)
    props = form.model_json_schema()["properties"]
    assert props["max_run_usd"]["default"] == 2.0 and props["max_cost_usd"]["default"] is None
    assert props["max_run_usd"]["description"].startswith("budget.max_run_usd")
    assert {"exclusiveMinimum": 0, "type": "number"} in props["max_run_usd"]["anyOf"]
    assert form._description == "the estimate is $5"
    answer = form(max_cost_usd=2e-9, overrides=["stages.full.max_steps=10"])
    assert answer.changes() == ["budget.max_run_usd=2.0", "budget.max_cost_usd=2e-09", "stages.full.max_steps=10"]
    assert form().changes() == ["budget.max_run_usd=2.0"]  # left as it was: the run's own budget, unchanged
