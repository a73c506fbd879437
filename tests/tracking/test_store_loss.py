"""The tracking store is lost mid-ladder: the ladder still completes and says how to deliver what the store missed.

Real everything: a `mlflow server` subprocess on a loopback port as the tracking store, the
`traingate run` CLI on the session's Prefect server, torchrun trees of 2 gloo ranks. The server
is stopped during canary at a seeded step and started again after the ladder; `traingate replay`
then delivers the journals, and the stage runs hold every metric step exactly once.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from test_outage import MlflowServer

from tgtest import PYTHON, ROOT

pytestmark = pytest.mark.slow

# Rank 0 sleeps 0.1 s a step, so the server can be stopped inside canary, not after it.
# The canary's rank 0 is slowed (slow@0:0) so the store can be killed mid-stage: 80 steps of a rank that
# slow are a real straggler, and the default straggler action (quarantine) would stop the stage. Here the
# subject is the tracking store, so the rule only notifies.
SETS = ["--set", "stages.canary.max_steps=80", "--set", "tracking.log_every=1", "--until", "canary",
        "--set", "alerts.straggler.action=notify"]


def _journal_steps(journal: Path) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    for line in journal.read_text().splitlines():
        r = json.loads(line)
        if "m" in r:
            steps.setdefault(r["m"], []).append(r["s"])
    return steps


def test_a_tracking_store_lost_mid_canary_never_fails_the_ladder_and_replay_delivers_every_record(
        prefect_api, tiny_spec, tmp_path, monkeypatch, capsys):
    from flows.cli import main

    server = MlflowServer(tmp_path / "mlflow-server")
    server.start()
    state = tmp_path / "state"
    env = {**os.environ, "TRAINGATE_STATE_DIR": str(state), "PREFECT_HOME": str(tmp_path / "prefect"),
           "TRAINGATE_TRACKING_URI": server.uri, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **prefect_api,
           # A refused connection fails at once (the tasks retry on their own), a stage's process
           # leaves its backlog in the journal after 2 s instead of the default 120 s, and the
           # orchestrator keeps a write after three quick retries instead of 1 + 5 + 15 s.
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "TRAINGATE_TRACKING_DRAIN_S": "2",
           "TRAINGATE_TRACKING_RETRY_S": "0.2,0.5,1"}
    stop_at = random.Random("store-loss").randint(3, 20)
    out = tmp_path / "run.out"
    t0 = time.monotonic()
    try:
        cli = subprocess.Popen([PYTHON, "-m", "flows.cli", "run", str(tiny_spec()), *SETS], cwd=ROOT,
                               env={**env, "TRAINGATE_INJECT": "slow@0:0"}, stdout=open(out, "w"),
                               stderr=subprocess.STDOUT)
        beat = None
        # Lost mid-run: after the canary has delivered some of its records, before it delivered them all.
        while beat is None or beat.get("step", 0) < stop_at or not list(
                state.glob("runs/*/canary/tracking/journal.jsonl.delivered")):
            assert cli.poll() is None, out.read_text()[-4000:]
            assert time.monotonic() - t0 < 400, "canary never reached step %d\n%s" % (stop_at, out.read_text()[-3000:])
            time.sleep(0.05)
            beats = list(state.glob("runs/*/canary/heartbeat.rank0.json"))
            try:
                beat = json.loads(beats[0].read_text()) if beats else None
            except ValueError:
                beat = None
        server.stop()
        stopped_at = beat["step"]
        code = cli.wait(400)
    finally:
        if cli.poll() is None:
            cli.kill()
    text = out.read_text()
    assert code == 0, text[-5000:]
    run_dir = next(state.glob("runs/*"))
    run_id = run_dir.name
    # The verdict and summary print, then the exact command to deliver what the store missed.
    assert "pipeline PASSED" in text and f"traingate replay {run_id}" in text, text[-4000:]
    assert "Traceback" not in text, text[-5000:]
    journal = run_dir / "canary" / "tracking" / "journal.jsonl"
    assert journal.stat().st_size > int((journal.parent / "journal.jsonl.delivered").read_text())
    kept = [json.loads(line)["call"] for line in (run_dir / "tracking" / "journal.jsonl").read_text().splitlines()]
    assert kept == ["record_stage", "close_pipeline_run"]
    ladder_s = time.monotonic() - t0

    server.start()
    c = MlflowClient(server.uri)
    assert c.get_run(run_id).info.status == "RUNNING"  # the close waits in the journal
    # `traingate replay` in this process (it imports no Prefect; a CLI process would add its start-up only)
    for k in ("TRAINGATE_STATE_DIR", "TRAINGATE_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
              "TRAINGATE_TRACKING_RETRY_S"):
        monkeypatch.setenv(k, env[k])
    capsys.readouterr()
    t1 = time.monotonic()
    code = main(["replay", run_id])
    replay_s = time.monotonic() - t1
    said = capsys.readouterr()
    assert code == 0, said.out + said.err[-3000:]
    assert "record-stage: made" in said.out and "close-pipeline-run: made" in said.out, said.out

    parent = c.get_run(run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["traingate.outcome"] == "passed"
    assert parent.data.tags["traingate.reached_stage"] == "canary"
    canary = c.search_runs([parent.info.experiment_id],
                           f"tags.`traingate.run_id` = '{run_id}' and tags.`traingate.stage` = 'canary'")[0]
    assert canary.info.status == "FINISHED" and canary.data.tags["traingate.gate_passed"] == "true"
    assert "stage.cost_usd" in canary.data.metrics
    expected = _journal_steps(journal)
    assert max(expected["train_loss"]) == 80 and stopped_at < 80
    for key, steps in expected.items():
        assert [m.step for m in c.get_metric_history(canary.info.run_id, key)] == steps, key
    assert {a.path for a in c.list_artifacts(canary.info.run_id, "gate")} >= {"gate/report.md"}

    # Idempotent: a second replay finds nothing and changes nothing.
    code = main(["replay", run_id])
    said = capsys.readouterr()
    assert code == 0 and "nothing to deliver" in said.out, said.out + said.err[-2000:]
    assert [m.step for m in c.get_metric_history(canary.info.run_id, "train_loss")] == expected["train_loss"]
    server.stop()
    print(f"ladder with the store lost at canary step {stopped_at}: {ladder_s:.1f} s; replay {replay_s:.1f} s")
