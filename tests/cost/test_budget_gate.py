"""Budget refusal before a stage starts, end to end: real Prefect (test harness), MLflow (sqlite) and torchrun.
From a terminal (`pause_wait_s` 0) the run ends refused; started from the UI it pauses for a new budget."""
from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tgtest import KeptRecords, wait_paused_for_input

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


def test_a_full_stage_over_what_is_left_of_the_run_budget_is_refused_naming_it_when_not_resumed_in_time(
        prefect_harness, state_dir, tiny_spec):
    from flows.pipeline import ladder
    from traingate.spec import load_spec

    # unit, smoke and canary hold a few slot-seconds (well under $0.01 at $0.05 per slot-hour); 100,000 full
    # steps at the canary's pace cost several times what is left of the run's $0.01. Run as a deployment runs
    # it, the gate's refusal waits 1 s for its Resume form, then ends the run as the terminal's does.
    spec = load_spec(tiny_spec(), ["stages.full.max_steps=100000", "budget.max_run_usd=0.01"])
    state = ladder(spec, "full", pause_wait_s=1, return_state=True)
    assert state.is_failed()
    assert state.message.startswith("gate after canary: FAILED: estimated cost of full $"), state.message
    assert "exceeds what is left of the run budget of " in state.message
    assert "raise budget.max_run_usd" in state.message
    run_id = state.result(raise_on_failure=False)["run_id"]
    assert state.message.endswith(f"(not resumed within pause_wait_s=1 s; `traingate resume {run_id} --set "
                                  "budget.max_run_usd=...` starts full)"), state.message
    assert "\n" not in state.message
    summary = state.result(raise_on_failure=False)
    assert list(summary["stages"]) == ["unit", "smoke", "canary"]
    assert not (Path(summary["run_dir"]) / "full").exists()
    spent = sum(s["cost_usd"] or 0.0 for s in summary["stages"].values())
    assert 0 < spent < 0.01


def test_a_ui_run_its_gate_refuses_on_budget_pauses_for_a_new_budget_and_a_sufficient_one_starts_the_stage(
        prefect_harness, state_dir, tiny_spec):
    from prefect import get_client

    from flows.pipeline import ladder
    from traingate.spec import load_spec

    # Any estimate of the canary exceeds a ceiling of $0.000000001: the smoke's gate refuses it on budget alone.
    spec = load_spec(tiny_spec(), ["budget.max_cost_usd=0.000000001"])
    handler = KeptRecords()  # Prefect's run loggers do not propagate to pytest's caplog
    logging.getLogger("prefect.flow_runs").addHandler(handler)
    box: dict[str, object] = {}
    since = datetime.now(UTC)
    t = threading.Thread(target=lambda: box.update(state=ladder(spec, "canary", pause_wait_s=300, return_state=True)))
    t.start()
    try:
        with get_client(sync_client=True) as c:
            fr, keyset = wait_paused_for_input(c, since, described=True)
            run_id = fr.name
            assert not (state_dir / "runs" / run_id / "canary").exists()  # refused before it starts
            # the form the UI draws: the budgets first, starting at the run's own; above it, the estimate
            schema = c.read_flow_run_input(fr.id, keyset["schema"])
            props = json.loads(schema)["properties"]
            assert sorted(props, key=lambda k: props[k]["position"]) == \
                ["resume", "max_run_usd", "max_cost_usd", "overrides", "reviewer", "reason"]
            assert props["max_cost_usd"]["default"] == 0.000000001 and props["max_run_usd"]["default"] is None
            told = json.loads(c.read_flow_run_input(fr.id, keyset["description"]))
            assert told.startswith("**The gate after smoke refused canary on its budget.** The estimate of canary "
                                   "is $"), told
            assert "budget.max_run_usd is unset, its budget.max_cost_usd $1e-09" in told, told
            # a budget the estimate still exceeds: one line, and the run stays paused
            low = c.resume_flow_run(fr.id, run_input={"max_cost_usd": 0.000000002, "reviewer": "ana"})
            assert low.status.value == "ACCEPT", low
            again, _ = wait_paused_for_input(c, since, {keyset["response"]})
            assert again.id == fr.id
            ok = c.resume_flow_run(fr.id, run_input={"max_cost_usd": 100, "reviewer": "ana", "reason": "worth it"})
            assert ok.status.value == "ACCEPT", ok
        t.join(timeout=600)
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(handler)
    state = box["state"]
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["run_id"] == run_id and summary["flow_run_id"] == str(fr.id)
    assert list(summary["stages"]) == ["unit", "smoke", "canary"]
    assert summary["stages"]["canary"]["status"] == "completed"
    assert "max_cost_usd: 100" in (state_dir / "runs" / run_id / "spec.yaml").read_text()  # as `traingate resume`
    said = handler.messages()
    refused = [m for m in said if m.startswith("Resume of canary refused")]
    assert len(refused) == 1, said
    assert refused[0].startswith("Resume of canary refused: asked budget.max_cost_usd=2e-09: estimated cost of the "
                                 "next stage $"), refused[0]
    assert refused[0].endswith("exceeds budget.max_cost_usd $2e-09; the run stays paused"), refused[0]
    # one logical run: the same MLflow parent, one run per stage, finished
    client = MlflowClient(Settings.from_env().tracking_uri)
    parent = client.get_run(run_id)
    stages = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    assert sorted(r.data.tags["traingate.stage"] for r in stages) == ["canary", "smoke", "unit"]
    assert parent.info.status == "FINISHED"
