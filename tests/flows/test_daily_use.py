"""What users meet every day: failed gates in a flow run's logs, restart counts, names, keys, the CLI.

Real Prefect (test harness), real MLflow (sqlite), real torchrun; stages are tiny."""
from __future__ import annotations

import logging

import pytest
import yaml

from traingate.settings import Settings

pytestmark = pytest.mark.slow

_UNIT_GATE_FAILS = """
gates:
  unit:
    rules:
      - {metric: tests_passed, op: ">=", value: 100000}
"""


def _flow_run_logs(flow_run_id) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the handler ships records from a background worker: drain it
    with get_client(sync_client=True) as c:
        return c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def test_a_failed_gate_run_as_a_deployment_ends_failed_with_its_reason_and_no_traceback_in_the_logs(
        prefect_harness, state_dir, tiny_spec, request):
    """The deployment path: a flow run created on the server, run by the engine as a worker's process
    runs it (``prefect.engine``: ``run_flow`` with the flow run's logger as error logger)."""
    from prefect import get_client
    from prefect.flow_engine import run_flow
    from prefect.logging.loggers import flow_run_logger

    from flows.pipeline import RunStopped, ladder

    logger = logging.getLogger("prefect.flow_runs")
    level = logger.level
    logger.setLevel(logging.INFO)  # the session's WARNING would hide the "Finished in state" line
    request.addfinalizer(lambda: logger.setLevel(level))
    spec = yaml.safe_load(tiny_spec(_UNIT_GATE_FAILS).read_text())
    with get_client(sync_client=True) as c:
        fr = c.create_flow_run(ladder, parameters={"spec": spec, "until": "smoke"})
    with pytest.raises(RunStopped) as stopped:  # the engine hands the outcome back; the process exits 1
        run_flow(ladder, flow_run=fr, error_logger=flow_run_logger(fr))
    assert list(stopped.value["stages"]) == ["unit"]

    with get_client(sync_client=True) as c:
        state = c.read_flow_run(fr.id).state
    assert state.is_failed()
    assert state.message.startswith("gate after unit: FAILED: tests_passed = "), state.message
    assert "required >= 100000" in state.message
    logs = _flow_run_logs(fr.id)
    text = "\n".join(f"{log.level} {log.message}" for log in logs)
    assert "Unexpected result" not in text and "Traceback" not in text, text
    assert not [log for log in logs if log.level >= 40], text
    assert "gate after unit: FAILED" in text  # "Finished in state Failed('<reason>')"


@pytest.fixture(scope="module")
def healthy_run(prefect_harness, tmp_path_factory):
    """One healthy ladder up to smoke (its smoke stage stops half way and resumes, on purpose)."""
    from tgtest import TINY_DIGITS

    from flows.pipeline import ladder
    from traingate.spec import parse_spec

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINGATE_STATE_DIR", str(tmp_path_factory.mktemp("healthy") / "state"))
        state = ladder(parse_spec(yaml.safe_load(TINY_DIGITS)), "smoke", return_state=True)
        assert state.is_completed(), state.message
        yield {"state": state, "summary": state.result(), "settings": Settings.from_env()}


def test_a_healthy_run_counts_no_restarts_though_its_smoke_stage_stops_and_resumes_on_purpose(healthy_run):
    from traingate.tracking import browse, runs

    summary = healthy_run["summary"]
    assert summary["stages"]["smoke"]["restarts"] == 0
    assert summary["stages"]["smoke"]["resumed_from_step"] == 2  # it did stop and resume
    c = runs.client(healthy_run["settings"].tracking_uri)
    smoke = c.get_run(summary["stages"]["smoke"]["mlflow_run_id"])
    assert smoke.data.tags["traingate.restart.1.cause"] == "stopped"  # the second process is on record...
    assert runs.restarts(smoke) == [] and smoke.data.metrics["stage.restarts"] == 0  # ...and is no restart
    assert c.get_run(summary["run_id"]).data.metrics["pipeline.restarts"] == 0
    shown = browse.show_run(c, summary["run_id"])
    assert "restart" not in shown, shown


def test_the_flow_run_is_named_after_the_traingate_run_id_and_its_task_runs_after_the_stages(healthy_run):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    run_id = healthy_run["summary"]["run_id"]
    flow_run_id = healthy_run["state"].state_details.flow_run_id
    with get_client(sync_client=True) as c:
        assert c.read_flow_run(flow_run_id).name == run_id
        names = {t.name for t in c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))}
    # record-<stage> publishes its report too, but for the run's last stage: its report goes out beside the tail
    assert {"unit", "smoke", "record-unit", "record-smoke"} <= names, names


def test_stage_reports_are_keyed_by_run_and_sort_in_ladder_order(healthy_run):
    from prefect.artifacts import Artifact

    run_id = healthy_run["summary"]["run_id"]
    keys = [f"tg-{run_id}-1-unit", f"tg-{run_id}-2-smoke"]
    for key in keys:
        artifact = Artifact.get(key)
        assert artifact is not None and run_id in artifact.description, key
    assert sorted(keys) == keys


def test_mlflow_run_names_differ_between_runs_of_one_spec_and_end_in_the_run_id(state_dir, tiny_spec):
    from traingate.spec import load_spec
    from traingate.tracking import runs

    s = Settings.from_env()
    s.ensure()
    c = runs.client(s.tracking_uri)
    spec = load_spec(tiny_spec())
    identity = {"code": {"sha": "abc", "dirty": "false"}, "data_snapshot": "d", "data_uri": "u",
                "environment": {"python": "3.11"}}
    first = runs.open_pipeline_run(c, spec, s.artifact_uri, identity, request_key="pipeline-1")
    second = runs.open_pipeline_run(c, spec, s.artifact_uri, identity, request_key="pipeline-2")
    names = [c.get_run(r).info.run_name for r in (first, second)]
    assert names[0] != names[1]
    assert names == [f"digits-cnn-{spec.spec_hash()[:6]}-{first[:8]}", f"digits-cnn-{spec.spec_hash()[:6]}-{second[:8]}"]
    # a retried request finds the run it created (renamed or not), and makes no second one
    assert runs.open_pipeline_run(c, spec, s.artifact_uri, identity, request_key="pipeline-1") == first
    stage = runs.open_stage_run(c, first, "smoke", request_key="stage-1")
    assert c.get_run(stage).info.run_name == f"{names[0]}/smoke"
