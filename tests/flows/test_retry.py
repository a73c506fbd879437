"""Prefect's Retry of a failed or a crashed ladder flow run continues the traingate run that flow run started.

Real Prefect (the session's server), a real deployment of the ladder flow, real MLflow (sqlite) and real
torchrun. The flow run is run by the engine as a worker's process runs it (``run_flow`` on the flow run): in
this process, or in a child process that is killed with its whole tree, as a lost node or pod ends it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from uuid import uuid4

import psutil
import pytest
import yaml
from tgtest import ROOT

from traingate.settings import Settings

pytestmark = pytest.mark.slow

# A worker's flow-run process: the engine runs the flow run it is given.
FLOW_RUN_PROCESS = """
import sys
from uuid import UUID
from prefect import get_client
from prefect.flow_engine import run_flow
from flows.pipeline import ladder
with get_client(sync_client=True) as c:
    fr = c.read_flow_run(UUID(sys.argv[1]))
run_flow(ladder, flow_run=fr, return_type="state")
"""


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process and every descendant at once, as the loss of its node would."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)
    psutil.wait_procs(tree, timeout=60)


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the flow-run process ended ({proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s:.0f} s"
        time.sleep(0.2)


def test_retrying_a_failed_then_a_crashed_ladder_flow_run_continues_the_same_run_from_its_last_checkpoint(
    prefect_api, state_dir, tiny_spec, monkeypatch
):
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.flow_engine import run_flow
    from prefect.states import AwaitingRetry, Crashed

    from flows.pipeline import ladder
    from traingate.tracking import runs

    # The canary (20 steps, a checkpoint every 5) raises at step 8, as a bug in recipe code would; its retry
    # hangs at step 15 (rank 0 stopped), where its flow-run process is killed; a fault fires once per stage
    # directory, so the second retry trains on past both. From step 9 rank 0 takes 0.1 s a step, so the
    # step-10 checkpoint's save (in the background) ends before the stop freezes rank 0 and it with it.
    monkeypatch.setenv("TRAINGATE_INJECT", "error@7,slow@9:0,stop@14:0")
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # a deployed flow run prepends its code
    spec = yaml.safe_load(tiny_spec().read_text())
    # The gate's subject here is the run continuing, not the loss curve (a resumed stage's loss_decrease_fraction
    # is its whole curve's: tests/runtime/test_stage_summary.py).
    spec["gates"]["canary"]["rules"] = [{"metric": "nonfinite_steps", "op": "==", "value": 0}]
    with get_client(sync_client=True) as c:
        deployment_id = c.create_deployment(flow_id=c.create_flow(ladder), name=f"retry-{uuid4().hex[:8]}")
        fr = c.create_flow_run_from_deployment(deployment_id, parameters={"spec": spec, "until": "canary"})

    first = run_flow(ladder, flow_run=fr, return_type="state")
    assert first.is_failed(), first.message
    before = first.result(raise_on_failure=False).summary
    run_id, run_dir = before["run_id"], state_dir / "runs" / before["run_id"]
    assert before["stages"]["canary"]["status"] == "failed", before
    smoke_record = (run_dir / "smoke" / "supervisor.json").read_text()

    def retry() -> None:
        with get_client(sync_client=True) as c:
            # What the UI's Retry button does: the flow run back to Scheduled (AwaitingRetry), for its worker.
            answer = c.set_flow_run_state(fr.id, AwaitingRetry(message="Retry from the UI"))
            assert answer.state is not None and answer.state.type == StateType.SCHEDULED, answer

    # The first retry runs in a worker's flow-run process, killed with its training processes once the canary
    # hangs past its step-10 checkpoint; the worker then reports the flow run Crashed.
    retry()
    proc = subprocess.Popen([sys.executable, "-c", FLOW_RUN_PROCESS, str(fr.id)], cwd=ROOT,
                            env={**os.environ, **prefect_api}, start_new_session=True)
    try:
        _wait_for(state_dir / "checkpoints" / run_id / "canary" / "step_00000010" / "manifest.json", proc)
        _wait_for(run_dir / "canary" / "faults" / "stop@14-r0.rank0.json", proc)
    finally:
        _kill_tree(proc)
    with get_client(sync_client=True) as c:
        answer = c.set_flow_run_state(fr.id, Crashed(message=f"flow run process exited {proc.returncode}"))
        assert answer.state is not None and answer.state.type == StateType.CRASHED, answer

    retry()
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(fr.id)
    second = run_flow(ladder, flow_run=fr, return_type="state")
    assert second.is_completed(), second.message
    after = second.result()
    with get_client(sync_client=True) as c:
        assert c.read_flow_run(fr.id).state.type == StateType.COMPLETED  # not marked crashed by its own retry

    assert after["run_id"] == run_id and after["flow_run_id"] == str(fr.id) and after["resumed"], after
    assert list(after["stages"]) == ["canary"], after  # unit and smoke passed before: not run again
    assert (run_dir / "smoke" / "supervisor.json").read_text() == smoke_record
    canary = after["stages"]["canary"]
    assert canary["mlflow_run_id"] == before["stages"]["canary"]["mlflow_run_id"], (before, after)
    assert canary["resumed_from_step"] == 10, canary  # the checkpoint saved before the crash
    attempts = json.loads((run_dir / "canary" / "supervisor.json").read_text())["attempts"]
    assert attempts[-1]["start_steps"] == {"0": 10, "1": 10}, attempts  # both ranks from step 10
    # Every attempt of the canary, the killed one too, in its log: from 0, the failed run's retry from 5
    # (its checkpoint before the failure), the crashed run's retry from 10.
    log = (run_dir / "canary" / "stdout.log").read_text()
    starts = re.findall(r"stage canary: world 2 on \w+ \(backend \w+\), steps (\d+) -> 20", log)
    assert list(dict.fromkeys(starts)) == ["0", "5", "10"], starts

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
