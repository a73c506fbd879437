"""Prefect's Retry of a failed ladder flow run continues the traingate run that flow run started.

Real Prefect (the session's server), a real deployment of the ladder flow, real MLflow (sqlite) and real
torchrun. The flow run is run by the engine as a worker's process runs it (``run_flow`` on the flow run)."""

from __future__ import annotations

import json
import os
from uuid import uuid4

import pytest
import yaml

from traingate.settings import Settings

pytestmark = pytest.mark.slow


def test_retrying_a_failed_ladder_flow_run_continues_the_same_run_from_the_failed_stage_checkpoint(
    prefect_api, state_dir, tiny_spec, monkeypatch
):
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.flow_engine import run_flow
    from prefect.states import AwaitingRetry

    from flows.pipeline import ladder
    from traingate.tracking import runs

    # The canary (20 steps, a checkpoint every 5) raises at step 8, as a bug in recipe code would; a fault
    # fires once per stage directory, so the retried canary trains on past it.
    monkeypatch.setenv("TRAINGATE_INJECT", "error@7")
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # a deployed flow run prepends its code
    spec = yaml.safe_load(tiny_spec().read_text())
    with get_client(sync_client=True) as c:
        deployment_id = c.create_deployment(flow_id=c.create_flow(ladder), name=f"retry-{uuid4().hex[:8]}")
        fr = c.create_flow_run_from_deployment(deployment_id, parameters={"spec": spec, "until": "canary"})

    first = run_flow(ladder, flow_run=fr, return_type="state")
    assert first.is_failed(), first.message
    before = first.result(raise_on_failure=False).summary
    run_id, run_dir = before["run_id"], state_dir / "runs" / before["run_id"]
    assert before["stages"]["canary"]["status"] == "failed", before
    smoke_record = (run_dir / "smoke" / "supervisor.json").read_text()

    with get_client(sync_client=True) as c:
        # What the UI's Retry button does: the failed flow run back to Scheduled (AwaitingRetry), for its worker.
        answer = c.set_flow_run_state(fr.id, AwaitingRetry(message="Retry from the UI"))
        assert answer.state is not None and answer.state.type == StateType.SCHEDULED, answer
        fr = c.read_flow_run(fr.id)
    second = run_flow(ladder, flow_run=fr, return_type="state")
    assert second.is_completed(), second.message
    after = second.result()

    assert after["run_id"] == run_id and after["flow_run_id"] == str(fr.id) and after["resumed"], after
    assert list(after["stages"]) == ["canary"], after  # unit and smoke passed before: not run again
    assert (run_dir / "smoke" / "supervisor.json").read_text() == smoke_record
    canary = after["stages"]["canary"]
    assert canary["mlflow_run_id"] == before["stages"]["canary"]["mlflow_run_id"], (before, after)
    assert canary["resumed_from_step"] == 5, canary  # the checkpoint saved before the failure
    attempts = json.loads((run_dir / "canary" / "supervisor.json").read_text())["attempts"]
    assert attempts[-1]["start_steps"] == {"0": 5, "1": 5}, attempts  # both ranks from step 5

    c = runs.client(Settings.from_env().tracking_uri)
    parent = c.get_run(run_id)  # the same MLflow parent run, closed as passed
    assert parent.info.status == "FINISHED", parent.info
    experiment = parent.info.experiment_id
    pipelines = c.search_runs(
        [experiment], f"tags.`traingate.run_id` = '{run_id}' and tags.`traingate.kind` = 'pipeline'"
    )
    assert [r.info.run_id for r in pipelines] == [run_id]
    canaries = c.search_runs(
        [experiment], f"tags.`traingate.run_id` = '{run_id}' and tags.`traingate.stage` = 'canary'"
    )
    assert [r.info.run_id for r in canaries] == [canary["mlflow_run_id"]]
