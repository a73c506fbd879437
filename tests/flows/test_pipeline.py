"""The ladder end to end: real Prefect (test harness), real MLflow (sqlite), real torchrun."""
from __future__ import annotations

import logging
import re
import shutil
import threading
import time
from datetime import UTC, datetime

import pytest
from mlflow.tracking import MlflowClient
from tgtest import ROOT, KeptRecords, paused_flow_runs

from traingate.settings import Settings

pytestmark = pytest.mark.slow


def _client() -> MlflowClient:
    return MlflowClient(Settings.from_env().tracking_uri)


def _children(client: MlflowClient, parent_id: str) -> dict[str, object]:
    exp = client.get_run(parent_id).info.experiment_id
    runs = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.data.tags["traingate.stage"]: r for r in runs}


def test_failing_training_code_tests_stop_the_ladder_at_the_unit_gate(prefect_harness, state_dir, tmp_path):
    from flows.pipeline import pipeline

    examples = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", examples, ignore=shutil.ignore_patterns("__pycache__"))
    (examples / "script_project" / "tests" / "test_broken.py").write_text(
        "def test_loss_is_connected():\n    assert False, 'loss does not depend on the model'\n")
    state = pipeline(str(examples / "script.yaml"), [], "full", return_state=True)
    assert state.is_failed()
    assert state.message == "gate after unit: FAILED: tests_failed = 1, required == 0"
    assert list(state.result(raise_on_failure=False)["stages"]) == ["unit"]


def test_script_recipe_climbs_the_ladder_with_metrics_read_from_its_output(prefect_harness, state_dir, tmp_path):
    from flows.pipeline import pipeline

    examples = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", examples, ignore=shutil.ignore_patterns("__pycache__"))
    state = pipeline(str(examples / "script.yaml"), ["recipe.script.stage_args.full=[--steps, '60']"], "full",
                     return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    client = _client()
    stages = _children(client, summary["run_id"])
    assert stages["unit"].data.metrics["stage.tests_passed"] == 2
    full = stages["full"]
    assert full.data.metrics["stage.acc"] >= 0.9 and full.data.metrics["stage.steps"] == 60
    assert len(client.get_metric_history(full.info.run_id, "loss")) == 60
    # the script logged into the same run through the MLFLOW_RUN_ID it was handed
    assert len(client.get_metric_history(full.info.run_id, "script_loss")) == 6


def _wait_for_paused_run(since: datetime, timeout_s: float = 180):
    from prefect import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as c:
        while time.monotonic() < deadline:
            for fr in paused_flow_runs(c, since):
                return fr.id
            time.sleep(1)
    raise AssertionError("no flow run paused for approval")


@pytest.mark.parametrize("approve", [True, False])
def test_approval_gate_pauses_the_ladder_until_a_reviewer_answers(prefect_harness, state_dir, tiny_spec, approve):
    from prefect.flow_runs import resume_flow_run

    from flows.pipeline import pipeline

    handler = KeptRecords(logging.WARNING)  # Prefect's run loggers do not propagate to pytest's caplog
    logging.getLogger("prefect.flow_runs").addHandler(handler)

    spec = tiny_spec()
    gate = ["gates.unit.require_approval=true", "gates.unit.approval_timeout_s=300",
            "gates.unit.rules=[{metric: tests_failed, op: '==', value: 0}]"]
    box: dict[str, object] = {}
    since = datetime.now(UTC)
    t = threading.Thread(target=lambda: box.update(state=pipeline(str(spec), gate, "smoke", return_state=True)))
    t.start()
    run_id = _wait_for_paused_run(since)
    logging.getLogger("prefect.flow_runs").removeHandler(handler)
    said = [m for m in handler.messages() if "paused for approval" in m]
    assert said == [f"paused for approval: unit passed its gate (gates.unit.require_approval); smoke starts when a "
                    f"reviewer resumes flow run {run_id} with {{approve: true, reviewer, reason}} (Prefect UI: "
                    f"Resume), within 300 s"], said
    resume_flow_run(run_id, run_input={"approve": approve, "reviewer": "ana", "reason": "looks fine" if approve
                                       else "wait for the data fix"})
    t.join(timeout=300)
    state = box["state"]
    if approve:
        assert state.is_completed(), state.message
        assert list(state.result()["stages"]) == ["unit", "smoke"]
    else:
        assert state.is_failed()
        assert state.message == "promotion to smoke rejected by ana: wait for the data fix"


def test_a_canary_with_zero_learning_rate_stops_before_full_and_the_cli_prints_the_failing_rule_and_exits_1(
        prefect_harness, state_dir, tiny_spec, capsys):
    """One ladder, `traingate run` on the session's Prefect server, read from both ends: what the
    terminal shows, and what the flow left in MLflow and the run directory. The command runs in this
    process (`flows.cli.main`, whose return is the process's exit code): a `traingate` process of its
    own would add only its interpreter and imports."""
    from flows.cli import main

    code = main(["run", str(tiny_spec()), "--set", "optim.lr=0"])
    out, err = capsys.readouterr()
    assert code == 1, out[-2000:] + err[-2000:]
    assert "pipeline STOPPED: gate after canary: FAILED: loss_decrease_fraction = " in out
    assert "required >= 0.05" in out
    assert "traingate run / MLflow parent run:" in out and "prefect flow run:" in out
    run_id = re.search(r"traingate run / MLflow parent run: (\S+)", out).group(1)
    summary = out.split("traingate run / MLflow parent run:")[1].splitlines()
    assert [line.split()[0] for line in summary if re.match(r"  (unit|smoke|canary|full) ", line)] == \
        ["unit", "smoke", "canary"]
    client = _client()
    assert set(_children(client, run_id)) == {"unit", "smoke", "canary"}
    parent = client.get_run(run_id)
    assert parent.info.status == "FAILED" and parent.data.tags["traingate.reached_stage"] == "canary"
    assert not (state_dir / "runs" / run_id / "full").exists()
