"""A ladder paused mid-stage (here by its budget) waits, paused in Prefect, for the Resume form the Prefect UI shows
on the paused flow run; what the form submits (the API call the UI makes) continues the same traingate run.

Real everything: the session's Prefect server, MLflow on SQLite, torchrun."""
from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime

import pytest
from mlflow.tracking import MlflowClient
from tgtest import KeptRecords, wait_paused_for_input

from traingate.settings import Settings

pytestmark = pytest.mark.slow

# $100 a slot-hour, one slot: 2.8 cents a second against 15 cents; smoke's 80 steps take 8 s of training
# with the injected slowness (as tests/monitor/test_budget_cli.py). The smoke gate's default rule, resumed from a
# checkpoint, holds only when the pause comes after the first checkpoint, which a loaded machine may not reach.
BUDGET = ["stages.smoke.max_steps=80", "resources.procs_per_node=1", "pools.cpu-local.price_per_gpu_hour=100",
          "budget.max_run_usd=0.15", "gates.smoke.rules=[{metric: nonfinite_steps, op: '==', value: 0}]"]


def test_a_budget_pause_resumes_from_the_ui_form_into_the_same_run_and_a_bad_override_keeps_it_paused(
        prefect_api, state_dir, tiny_spec, monkeypatch):
    from prefect import get_client

    from flows.pipeline import ladder
    from traingate.spec import load_spec

    monkeypatch.setenv("TRAINGATE_INJECT", "slow@0:0")
    spec = load_spec(tiny_spec(), BUDGET)
    handler = KeptRecords()  # Prefect's run loggers do not propagate to pytest's caplog
    logging.getLogger("prefect.flow_runs").addHandler(handler)
    box: dict[str, object] = {}
    since = datetime.now(UTC)
    t = threading.Thread(target=lambda: box.update(state=ladder(spec, "smoke", pause_wait_s=300, return_state=True)))
    t.start()
    try:
        with get_client(sync_client=True) as c:
            fr, keyset = wait_paused_for_input(c, since)
            run_id = fr.name  # the ladder names its flow run after the traingate run
            # the form the UI draws on the paused run: the Resume input's schema, fields in declared order
            schema = json.loads(c.read_flow_run_input(fr.id, keyset["schema"]))
            assert sorted(schema["properties"], key=lambda k: schema["properties"][k]["position"]) == \
                ["resume", "overrides", "reviewer", "reason"]
            # the server checks what the form submits against that schema
            wrong = c.resume_flow_run(fr.id, run_input={"resume": "maybe"})
            assert wrong.status.value == "REJECT" and "resume" in wrong.details.reason, wrong
            # a value the schema accepts but that makes no valid spec: refused in one line, paused again
            once = c.resume_flow_run(fr.id, run_input={"overrides": ["budget.max_run_usd=-1"], "reviewer": "ana"})
            assert once.status.value == "ACCEPT", once
            again, _ = wait_paused_for_input(c, since, {keyset["response"]})
            assert again.id == fr.id
            ok = c.resume_flow_run(fr.id, run_input={"resume": True, "overrides": ["budget.max_run_usd=100"],
                                                      "reviewer": "ana", "reason": "the sweep found it worth it"})
            assert ok.status.value == "ACCEPT", ok
        t.join(timeout=600)
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(handler)
    state = box["state"]
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["run_id"] == run_id and summary["flow_run_id"] == str(fr.id)
    assert summary["stages"]["smoke"]["status"] == "completed"
    assert "max_run_usd: 100" in (state_dir / "runs" / run_id / "spec.yaml").read_text()  # as `traingate resume`
    said = handler.messages()
    pause = [m for m in said if "paused by alert budget-exhausted" in m]
    assert len(pause) == 2 and f"or resume flow run {fr.id} from the Prefect UI" in pause[0], said
    refused = [m for m in said if m.startswith("Resume of smoke refused")]
    assert len(refused) == 1 and "budget.max_run_usd" in refused[0] and "-1" in refused[0], said
    # one logical run: the same MLflow parent, one smoke stage run, finished
    client = MlflowClient(Settings.from_env().tracking_uri)
    parent = client.get_run(run_id)
    stages = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    assert sorted(r.data.tags["traingate.stage"] for r in stages) == ["smoke", "unit"]
    assert parent.info.status == "FINISHED"


def test_traingate_resume_of_a_run_waiting_for_the_ui_takes_it_over_and_the_paused_flow_run_leaves_it_alone(
        prefect_api, state_dir, tiny_spec, monkeypatch):
    from prefect import get_client

    from flows.pipeline import ResumeFrom, ladder
    from traingate.spec import load_spec

    monkeypatch.setenv("TRAINGATE_INJECT", "slow@0:0")
    spec = load_spec(tiny_spec(), BUDGET)
    box: dict[str, object] = {}
    since = datetime.now(UTC)
    t = threading.Thread(target=lambda: box.update(state=ladder(spec, "smoke", pause_wait_s=300, return_state=True)))
    t.start()
    with get_client(sync_client=True) as c:
        fr, _ = wait_paused_for_input(c, since)
    run_id = fr.name
    # what `traingate resume RUN_ID --set budget.max_run_usd=100` runs, while the first flow run waits paused
    resumed = ladder(None, "smoke", ResumeFrom(run_id=run_id, overrides=["budget.max_run_usd=100"]), return_state=True)
    assert resumed.is_completed(), resumed.message
    with get_client(sync_client=True) as c:
        assert c.resume_flow_run(fr.id, run_input={"resume": True}).status.value == "ACCEPT"
    t.join(timeout=300)
    waited = box["state"]
    assert waited.is_cancelled(), waited.message
    assert waited.message == f"smoke: continued by flow run {resumed.result()['flow_run_id']} (traingate resume)"
    parent = MlflowClient(Settings.from_env().tracking_uri).get_run(run_id)
    assert parent.info.status == "FINISHED"  # closed by the resume, not reopened or failed by the waiting run
