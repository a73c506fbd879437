"""Cancelling the flow run preempts the tree; `traingate resume RUN_ID` finishes it. Real Prefect (harness)."""
from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from traingate.runtime.checkpoint import Checkpointer
from traingate.runtime import inject

pytestmark = pytest.mark.slow

SPEC = """
stages:
  full: {max_steps: 40}
tracking: {enabled: true, log_every: 10}
supervision: {backoff_base_s: 0.2, hang_timeout_s: 20, preempt_grace_s: 30}
"""


def _wait_for(predicate, timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_cancelling_the_flow_run_preempts_the_tree_with_a_checkpoint_and_resume_finishes_it(
        prefect_harness, tiny_spec, state_dir, monkeypatch):
    from prefect import flow, get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.runtime import flow_run
    from prefect.states import Cancelled, Cancelling

    from flows.cli import main as cli
    from tasks.data import data_snapshot
    from tasks.tracking import open_pipeline_run, open_stage_run
    from tasks.train import run_stage_job
    from traingate.job.stagejob import derive
    from traingate.settings import Settings
    from traingate.spec import load_spec, write_resolved

    # A straggling rank keeps the run long enough to cancel; rank 1 is also killed once at step 2,
    # so the run restarts (and emits its event) before it is cancelled.
    monkeypatch.setenv(inject.ENV, "slow@0,kill@2:1")
    spec_path = tiny_spec(SPEC)
    box: dict[str, Any] = {}

    @flow(name="one-stage")
    def one_stage(path: str) -> Any:
        box["flow_run_id"] = flow_run.id
        spec = load_spec(path)
        data_hash, data_uri = data_snapshot(spec)
        run_id = open_pipeline_run(spec, data_hash, data_uri)
        run_dir = Settings.from_env().ensure().state_dir / "runs" / run_id
        box["run_dir"] = run_dir
        write_resolved(spec, run_dir / "spec.yaml")
        job = derive(spec, "full", run_id=run_id, run_dir=run_dir, settings=Settings.from_env(),
                     mlflow_run_id=open_stage_run(run_id, "full"))
        result = box["result"] = run_stage_job(job)
        return Cancelled(message=result.error) if result.status == "preempted" else result

    worker = threading.Thread(target=lambda: box.setdefault("state", one_stage(str(spec_path), return_state=True)))
    worker.start()
    try:
        def second_launch_training() -> bool:
            run_dir = box.get("run_dir")
            if run_dir is None or not (run_dir / "full" / "supervisor.json").exists():
                return False
            attempts = json.loads((run_dir / "full" / "supervisor.json").read_text())["attempts"]
            beat = run_dir / "full" / "heartbeat.rank0.json"
            try:
                return len(attempts) >= 1 and attempts[0]["cause"] == "worker_lost" and \
                    json.loads(beat.read_text())["step"] >= 5
            except (OSError, ValueError):
                return False
        _wait_for(second_launch_training, 180, "the relaunched run to train a few steps")
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(box["flow_run_id"], Cancelling(message="cancelled by a test"), force=True)
    finally:
        worker.join(timeout=240)
    assert not worker.is_alive()
    result = box["result"]
    run_dir = box["run_dir"]
    run_id = run_dir.name
    assert result.status == "preempted", result.error
    assert "cancelling" in result.error and f"traingate resume {run_id}" in result.error
    sup = result.details["supervision"]
    assert [a["cause"] for a in sup["attempts"]] == ["worker_lost", "preempted"]
    stopped_at = sup["attempts"][-1]["end_step"]
    ckpt = Checkpointer(json.loads((run_dir / "full" / "supervisor.json").read_text())["job"]["checkpoint_uri"])
    assert ckpt.find_latest() == stopped_at and ckpt.manifest(stopped_at)["emergency"] is True
    assert stopped_at < 40

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(box["flow_run_id"]).state.is_cancelled()
        # This run's: the session's Prefect server holds the events of every test before it on this worker.
        events = _wait_for(lambda: client.read_events(EventFilter(
            event=EventNameFilter(name=["traingate.run.restarted"]),
            resource=EventResourceFilter(id=[f"traingate.run.{run_id}"])), limit=10).events, 30, "the restart event")
    assert events[0].payload["cause"] == "worker_lost"
    assert events[0].resource.id == f"traingate.run.{run_id}"

    monkeypatch.delenv(inject.ENV)
    assert cli(["resume", run_id, "--stage", "full"]) == 0
    final = json.loads((run_dir / "full" / "result.json").read_text())
    assert final["status"] == "completed" and final["steps_done"] == 40
    assert final["resumed_from_step"] == stopped_at
    state = json.loads((run_dir / "full" / "supervisor.json").read_text())
    assert state["final"]["status"] == "completed"
    # One logical run: the stage's MLflow run holds both restarts with their causes (the tracker reads
    # them from the StageJob of each attempt, or torchrun's in-place restart count).
    from traingate.settings import Settings
    from traingate.tracking import runs

    tags = runs.client(Settings.from_env().tracking_uri).get_run(state["job"]["mlflow_run_id"]).data.tags
    assert tags["traingate.restart.1.cause"] == "worker_lost"
    assert tags["traingate.restart.2.cause"] == "preempted"
    assert tags["traingate.restart.2.resumed_from_step"] == str(stopped_at)
