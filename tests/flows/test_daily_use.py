"""What users meet every day: failed gates in a flow run's logs, restart counts, names, keys, the CLI.

Real Prefect (test harness), real MLflow (sqlite), real torchrun; stages are tiny."""
from __future__ import annotations

import logging

import pytest
import yaml

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
