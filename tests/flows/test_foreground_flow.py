"""A ladder run in the foreground (`traingate run`) on a real Prefect server: what its flow run reads of itself."""
from __future__ import annotations

from prefect import flow
from prefect.settings import get_current_settings

from flows.pipeline import _under_deployment, no_flow_heartbeats


@flow
def _probe() -> tuple[object, bool]:
    return get_current_settings().flows.heartbeat_frequency, _under_deployment()


def test_a_foreground_flow_run_sends_no_heartbeats_and_is_no_deployments(prefect_harness):
    with no_flow_heartbeats():
        assert _probe() == (None, False)
    # outside the context a flow run keeps Prefect's heartbeats (a worker's flow runs send them)
    heartbeat, under_deployment = _probe()
    assert heartbeat is not None and heartbeat > 0 and under_deployment is False
