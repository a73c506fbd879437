"""One logical run across process lifetimes: SIGKILLed and restarted processes resume the same MLflow run."""
from __future__ import annotations

import json
import signal

import pytest
from mlflow.tracking import MlflowClient

from tracking_helpers import (fresh_store, heartbeat, new_run, start_training, steps_of, train_env, wait_until,
                              write_spec)

STEPS = 300


@pytest.mark.slow
def test_run_killed_twice_is_one_mlflow_run_with_two_restarts_and_each_step_logged_once(tmp_path):
    uri = fresh_store(tmp_path / "mlflow.db")
    run_id = new_run(uri)
    spec = write_spec(tmp_path / "spec.yaml", STEPS)
    stage = tmp_path / "stage"
    log = tmp_path / "train.log"
    resumed_from, killed_at = [], []
    # The restart cause comes from the supervisor (TRAINGATE_RESTART_CAUSE of the restarted process).
    for kill_at in (70, 190):
        p = start_training(spec, train_env(uri, run_id, stage), log)
        wait_until(lambda: (hb := heartbeat(stage)) is not None and hb["pid"] == p.pid and hb["step"] >= kill_at,
                   240, f"step {kill_at}", p)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        killed_at.append(heartbeat(stage)["step"])
    # The last relaunch is not even told its MLflow run: it takes the one its checkpoint was written under.
    env = train_env(uri, run_id, stage, TRAINGATE_RESTART_CAUSE="worker_lost")
    del env["MLFLOW_RUN_ID"]
    p = start_training(spec, env, log)
    assert p.wait(240) == 0, log.read_text()[-3000:]

    result = json.loads((stage / "result.json").read_text())
    assert result["status"] == "completed" and result["steps_done"] == STEPS
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_run(run_id).info.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # still one MLflow run
    tags = client.get_run(run_id).data.tags
    assert tags["traingate.restarts"] == "2" and tags["traingate.sessions"] == "3"
    assert tags["traingate.restart.1.cause"] == "unknown"  # nobody said why
    assert tags["traingate.restart.2.cause"] == "worker_lost"
    for r in (1, 2):
        resumed_from.append(int(tags[f"traingate.restart.{r}.resumed_from_step"]))
        assert 0 <= resumed_from[-1] <= killed_at[r - 1] and resumed_from[-1] % 25 == 0
        assert float(tags[f"traingate.restart.{r}.time_lost_s"]) > 0
    assert resumed_from[1] > resumed_from[0]  # the second process got past a checkpoint before its kill
    assert result["resumed_from_step"] == resumed_from[1]
    for key in ("train_loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "system/rank0/cpu_percent"):
        assert steps_of(client, run_id, key) == list(range(1, STEPS + 1)), key
    assert [m.step for m in client.get_metric_history(run_id, "restart.resumed_from_step")] == [1, 2]
