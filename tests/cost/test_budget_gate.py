"""Budget refusal before `full`, end to end: real Prefect (test harness), MLflow (sqlite) and torchrun."""
from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from traingate.settings import Settings

pytestmark = pytest.mark.slow


def test_a_full_stage_the_canary_estimates_above_the_budget_is_refused_before_it_starts(prefect_harness, state_dir,
                                                                                       tiny_spec):
    from flows.pipeline import pipeline

    # 20 canary steps cost well under $0.001 on cpu-local ($0.05 per slot-hour, 2 slots); 10,000 full steps at
    # the canary's pace cost several times that. The smoke's estimate of the canary fits; the canary's of full does not.
    state = pipeline(str(tiny_spec()), ["stages.full.max_steps=10000", "budget.max_cost_usd=0.001"], "full",
                     return_state=True)
    assert state.is_failed()
    assert state.message.startswith("gate after canary: FAILED: estimated cost of the next stage $"), state.message
    assert state.message.endswith("exceeds budget.max_cost_usd $0.001")
    summary = state.result(raise_on_failure=False)
    assert list(summary["stages"]) == ["unit", "smoke", "canary"]
    assert not (Path(summary["run_dir"]) / "full").exists()
    client = MlflowClient(Settings.from_env().tracking_uri)
    canary = client.search_runs([client.get_run(summary["run_id"]).info.experiment_id],
                                f"tags.mlflow.parentRunId = '{summary['run_id']}' and tags.`traingate.stage` = 'canary'")
    est = canary[0].data.metrics["estimate.next_stage_cost_usd"]
    assert est > 0.001
    assert f"${est:.6g} exceeds" in state.message


def test_a_full_stage_that_does_not_fit_what_is_left_of_the_run_budget_is_refused_naming_it(prefect_harness, state_dir,
                                                                                          tiny_spec):
    from flows.pipeline import pipeline

    # unit, smoke and canary hold a few slot-seconds (well under $0.01 at $0.05 per slot-hour); 100,000 full
    # steps at the canary's pace cost several times what is left of the run's $0.01.
    state = pipeline(str(tiny_spec()), ["stages.full.max_steps=100000", "budget.max_run_usd=0.01"], "full",
                     return_state=True)
    assert state.is_failed()
    assert state.message.startswith("gate after canary: FAILED: estimated cost of full $"), state.message
    assert "exceeds what is left of the run budget of " in state.message
    assert "raise budget.max_run_usd" in state.message
    summary = state.result(raise_on_failure=False)
    assert list(summary["stages"]) == ["unit", "smoke", "canary"]
    assert not (Path(summary["run_dir"]) / "full").exists()
    spent = sum(s["cost_usd"] or 0.0 for s in summary["stages"].values())
    assert 0 < spent < 0.01
