"""Gates are pure functions of a StageResult."""
from __future__ import annotations

import math

from traingate.ladder.gates import decide
from traingate.spec import GateRule, GateSpec, default_gate
from traingate.job.result import StageResult, render_markdown


def _gate(*rules):
    return GateSpec(rules=[GateRule(metric=m, op=o, value=v) for m, o, v in rules])


def test_gate_passes_when_every_rule_holds():
    r = StageResult("canary", "completed", metrics={"loss_decrease_fraction": 0.4, "nonfinite_steps": 0})
    d = decide(r, _gate(("loss_decrease_fraction", ">=", 0.1), ("nonfinite_steps", "==", 0)))
    assert d.passed and d.reasons == []
    assert [ok for _, _, ok in d.evaluated] == [True, True, True]


def test_failed_rule_reason_names_metric_measured_value_and_threshold():
    r = StageResult("canary", "completed", metrics={"loss_decrease_fraction": 0.0})
    d = decide(r, _gate(("loss_decrease_fraction", ">=", 0.1)))
    assert not d.passed
    assert d.reasons == ["loss_decrease_fraction = 0, required >= 0.1"]
    assert "FAILED" in d.summary() and "loss_decrease_fraction = 0" in d.summary()


def test_unmeasured_metric_fails_the_gate_instead_of_passing_silently():
    d = decide(StageResult("full", "completed"), _gate(("val_accuracy", ">=", 0.9)))
    assert not d.passed and "val_accuracy was not measured" in d.reasons[0]


def test_nan_metric_never_satisfies_a_rule():
    r = StageResult("canary", "completed", metrics={"max_grad_norm": math.nan})
    assert not decide(r, _gate(("max_grad_norm", "<=", 10))).passed


def test_stage_that_did_not_complete_fails_with_its_error():
    r = StageResult("full", "diverged", metrics={"nonfinite_steps": 3}, error="diverged: loss is nan")
    d = decide(r, _gate(("nonfinite_steps", "==", 0)))
    assert not d.passed
    assert d.reasons[0] == "stage ended diverged: diverged: loss is nan"


def test_failed_check_fails_the_gate():
    r = StageResult("smoke", "completed", checks={"checkpoint_loads": False})
    assert decide(r, GateSpec()).reasons == ["check checkpoint_loads failed"]


def test_estimated_cost_over_budget_refuses_the_next_stage():
    r = StageResult("canary", "completed", estimate={"next_stage_cost_usd": 12.5})
    d = decide(r, GateSpec(), max_cost_usd=10.0)
    assert not d.passed and "exceeds budget.max_cost_usd $10" in d.reasons[0]
    assert decide(r, GateSpec(), max_cost_usd=20.0).passed
    assert decide(r, GateSpec(), max_cost_usd=None).passed


def test_script_recipes_get_gates_that_do_not_ask_for_a_resume():
    assert "resumed_from_step" in {r.metric for r in default_gate("smoke", script=False).rules}
    assert "resumed_from_step" not in {r.metric for r in default_gate("smoke", script=True).rules}


def test_markdown_report_shows_metrics_and_the_failing_rule():
    r = StageResult("canary", "completed", metrics={"loss_decrease_fraction": 0.0}, cost_usd=0.01)
    md = render_markdown(r, decide(r, _gate(("loss_decrease_fraction", ">=", 0.1))))
    assert "| loss_decrease_fraction | 0 |" in md
    assert "| loss_decrease_fraction >= 0.1 | 0 | **no** |" in md
