"""A script stage that restarts once, under the real supervisor and a real MLflow sqlite store: one restart
count from one record (the supervisor's), the same in `traingate show`, `traingate runs`, `traingate watch`
and MLflow; and a checkpoint whose name holds no step (ckpt.pt) is resumed "from an unknown step", with
no steps counted as lost."""
from __future__ import annotations

import time
import uuid
from pathlib import Path

from traingate.job.stagejob import derive
from traingate.job.vocab import Cause, Status
from traingate.ladder import outcomes
from traingate.ladder.gates import decide
from traingate.ladder.preflight import check_spec
from traingate.monitor.dashboard import read_snapshot
from traingate.settings import Settings
from traingate.spec import parse_spec
from traingate.supervision.supervisor import Hooks, supervise
from traingate.tracking import browse, runs
from traingate.tracking.identity import environment_snapshot

# Saves ckpt.pt (no step in its name) every 5 steps; the first run kills itself at step 12 (a lost worker).
TRAIN = """
import json, os, signal, sys, time
ckpt = os.path.join(os.environ["TRAINGATE_CHECKPOINT_DIR"], "ckpt.pt")
start = 0
if "--resume" in sys.argv:
    start = json.load(open(sys.argv[sys.argv.index("--resume") + 1]))["step"]
for step in range(start + 1, 21):
    print(f"step {step} loss {1.0 / step:.4f}", flush=True)
    if step % 5 == 0:
        with open(ckpt + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(ckpt + ".tmp", ckpt)
    if step == 12 and not os.path.exists("killed-once"):
        open("killed-once", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.01)
"""


def test_a_script_stage_restarted_once_counts_one_restart_in_show_runs_watch_and_mlflow_from_an_unknown_step(
        tmp_path, state_dir):
    workdir = tmp_path / "project"
    workdir.mkdir()
    (workdir / "train.py").write_text(TRAIN)
    spec = parse_spec({
        "identity": {"experiment": "scripts", "owner": "tester", "team": "platform",
                     "purpose": "a script stage that restarts once"},
        "recipe": {"name": "script", "script": {
            "workdir": str(workdir), "command": ["python", "train.py"], "checkpoints": "ckpt.pt",
            "resume_args": ["--resume", "${TRAINGATE_CHECKPOINT_DIR}/ckpt.pt"],
            "metrics": [r"step (?P<step>\d+) loss (?P<loss>[0-9.]+)"]}},
        "resources": {"work_pool": "cpu-local", "procs_per_node": 1},
        "supervision": {"backoff_base_s": 0, "backoff_max_s": 0, "hang_timeout_s": 30, "max_restarts": 2}})
    check_spec(spec)
    settings = Settings.from_env()
    client = runs.client(settings.tracking_uri)
    identity = {"code": {"sha": "sha256:test", "dirty": "false", "diff_hash": "", "source": "content"},
                "data_snapshot": "none", "data_uri": "", "environment": environment_snapshot()}
    key = uuid.uuid4().hex
    run_id = runs.open_pipeline_run(client, spec, settings.artifact_uri, identity, request_key=f"p-{key}")
    stage_run = runs.open_stage_run(client, run_id, "full", request_key=f"full-{key}")
    job = derive(spec, "full", run_id=run_id, run_dir=settings.state_dir / "runs" / run_id, settings=settings,
                 mlflow_run_id=stage_run)

    said: list[str] = []
    events: list[dict] = []
    t0 = time.monotonic()
    sup = supervise(job, Hooks(info=said.append, on_restart=events.append), seed=0)
    assert sup.status == Status.COMPLETED, sup.error
    assert [a.cause for a in sup.attempts] == [Cause.WORKER_LOST, None]

    # The restart from ckpt.pt: from an unknown step, no steps counted as lost (not "from step 0, 12 lost").
    assert len(events) == 1 and events[0]["resume_from_step"] == "unknown" and events[0]["steps_lost"] is None
    assert any("restart 1/2 from an unknown step" in line for line in said), said
    assert sup.attempts[1].resume_step_unknown and sup.attempts[1].resume_from_step is None

    result = outcomes.from_supervision(job, sup, time.monotonic() - t0)
    assert result.metrics["restarts"] == 1
    assert result.details["restarts"] == [
        {"n": "1", "cause": "worker_lost", "resumed_from_step": "unknown",
         "downtime_s": result.details["restarts"][0]["downtime_s"]}]
    runs.record_stage(client, stage_run, result, decide(result, spec.gate("full")))
    runs.close_pipeline_run(client, run_id, passed=True, reached="full")

    # MLflow: the stage's metric and tags, and the pipeline's total.
    stage = client.get_run(stage_run)
    assert stage.data.metrics["stage.restarts"] == 1
    assert runs.restart_count(stage) == 1 and runs.restarts(stage)[0]["resumed_from_step"] == "unknown"
    assert client.get_run(run_id).data.metrics["pipeline.restarts"] == 1
    # traingate runs and traingate show.
    row = next(r for r in browse.list_runs(client, "scripts") if r["run_id"] == run_id)
    assert row["restarts"] == 1
    shown = browse.show_run(client, run_id)
    assert "restart 1: cause worker_lost, resumed from step unknown" in shown and "restart 2" not in shown, shown
    assert "steps lost" not in shown
    # traingate watch: the same record, read from the stage directory.
    assert read_snapshot(Path(job.run_dir)).restarts == 1
