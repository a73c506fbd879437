"""StageJob: every fact of a stage attempt derived once, the same for validation, the scheduler and the process."""
from __future__ import annotations

import json
import os

import pytest

from tgtest import TINY_DIGITS
from traingate.job import envvars, files
from traingate.job.stagejob import JobKind, StageJob, derive
from traingate.job.vocab import Cause, Status
from traingate.settings import Settings
from traingate.spec import SpecError, load_spec_text
from traingate.ladder.preflight import check_spec

MULTINODE = ["resources.nodes=2", "resources.procs_per_node=2", "resources.rdzv_endpoint=10.0.0.1:29500",
             "optim.batch_size=32", "optim.grad_accum=1"]


def _settings(tmp_path) -> Settings:
    return Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path / "state")})


@pytest.mark.parametrize("canary_samples, full_samples, refused", [
    (100, None, None),        # canary: 32 x 2 processes = 64 <= 100 (a check with all 4 processes wrongly refused it)
    (50, None, "canary"),     # 64 > 50: the canary cannot run
    (None, 100, "full"),      # full: 32 x 4 processes = 128 > 100: the full stage cannot run
    (None, 128, None),        # exactly one global batch fits
], ids=["canary-fits-on-one-node", "canary-too-small", "full-too-small-for-two-nodes", "full-exactly-fits"])
def test_a_two_node_spec_passes_validation_exactly_when_its_stages_can_run(canary_samples, full_samples, refused):
    sets = list(MULTINODE)
    if canary_samples:
        sets.append(f"stages.canary.max_samples={canary_samples}")
    if full_samples:
        sets.append(f"stages.full.max_samples={full_samples}")
    spec = load_spec_text(TINY_DIGITS, sets)
    if refused is None:
        check_spec(spec)
    else:
        with pytest.raises(SpecError, match=rf"the {refused} stage's global batch"):
            check_spec(spec)


def test_each_stage_job_carries_the_world_and_slots_validation_used(tmp_path):
    spec = load_spec_text(TINY_DIGITS, MULTINODE)
    jobs = {s: derive(spec, s, run_id="r", run_dir=tmp_path / "r", settings=_settings(tmp_path))
            for s in ("smoke", "canary", "full")}
    assert [(j.nodes, j.procs_per_node, j.world_size, j.slots) for j in jobs.values()] == \
        [(1, 1, 1, 1), (1, 2, 2, 2), (2, 2, 4, 4)]
    full = jobs["full"]
    assert (full.pool, full.team, full.priority, full.kind) == ("cpu-local", "platform", "research", JobKind.LADDER)
    assert full.checkpoint_uri == (tmp_path / "state" / "checkpoints" / "r" / "full").as_uri()
    assert full.stage_dir == str(tmp_path / "r" / "full")


def test_a_stage_job_survives_its_file_and_a_restart_is_the_same_job_with_the_cause(tmp_path):
    spec = load_spec_text(TINY_DIGITS)
    job = derive(spec, "canary", run_id="r", run_dir=tmp_path, settings=_settings(tmp_path), mlflow_run_id="m1")
    again = StageJob.read(job.write())
    assert again == job and again.spec.spec_hash() == spec.spec_hash()
    nxt = job.next_attempt("worker_lost", 12.5)
    assert (nxt.attempt, nxt.restart_cause, nxt.restart_fault_ts) == (1, Cause.WORKER_LOST, 12.5)
    assert StageJob.read(nxt.write()).restart_cause is Cause.WORKER_LOST
    on_disk = json.loads(job.job_path.read_text())
    assert on_disk["restart_cause"] == "worker_lost" and on_disk["spec"]["identity"]["team"] == "platform"


def test_a_job_whose_tracking_is_off_hands_no_mlflow_run_to_its_processes(tmp_path):
    spec = load_spec_text(TINY_DIGITS, ["tracking.enabled=false"])
    job = derive(spec, "full", run_id="r", run_dir=tmp_path, settings=_settings(tmp_path), mlflow_run_id="m1")
    assert job.tracking_uri is None and job.mlflow_run_id is None
    env = envvars.job_environment(job, base={"MLFLOW_RUN_ID": "stale", "MLFLOW_TRACKING_URI": "x"})
    assert "MLFLOW_RUN_ID" not in env


def test_the_environment_a_job_writes_is_what_its_readers_read(tmp_path):
    spec = load_spec_text(TINY_DIGITS)
    job = derive(spec, "full", run_id="r9", run_dir=tmp_path, settings=_settings(tmp_path), mlflow_run_id="m9")
    job = job.next_attempt(Cause.PREEMPTED, 1.0)
    env = envvars.job_environment(job, base={}, supervisor_pid=4242)
    assert envvars.job_path(env) == job.job_path
    assert envvars.supervisor_pid(env) == 4242
    # What a user's script reads (docs/scripts.md's promise).
    assert (env["TRAINGATE_RUN_ID"], env["TRAINGATE_STAGE"], env["TRAINGATE_CHECKPOINT_DIR"]) == \
        ("r9", "full", job.checkpoint_uri)
    assert (env["MLFLOW_RUN_ID"], env["TRAINGATE_RESTART_CAUSE"], env["TRAINGATE_RESTART_COUNT"]) == \
        ("m9", "preempted", "1")


def test_every_platform_variable_is_defined_in_the_envvars_module_only():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    defined = set(re.findall(r'"(TRAINGATE_[A-Z_]+)"', (root / "traingate/job/envvars.py").read_text()))
    # The locations and the CLI's switches: the settings module, and what the `traingate` process reads before its
    # hand-over (commandenv.py, which the settings module re-exports).
    settings = {name for module in ("settings.py", "commandenv.py")
                for name in re.findall(r'"(TRAINGATE_[A-Z_]+)"', (root / "traingate" / module).read_text())}
    strays = {}
    for p in [*root.glob("traingate/**/*.py"), *root.glob("tasks/*.py"), *root.glob("flows/**/*.py")]:
        if p.name in ("envvars.py", "settings.py", "commandenv.py"):
            continue
        for name in re.findall(r'"(TRAINGATE_[A-Z_]+)"', p.read_text()):
            if name not in settings and not name.startswith("TRAINGATE_SECRET"):
                strays.setdefault(name, []).append(str(p.relative_to(root)))
    assert not strays, f"TRAINGATE_* variables spelled outside traingate/job/envvars.py: {strays}"
    assert {"TRAINGATE_JOB", "TRAINGATE_RUN_ID", "TRAINGATE_SUPERVISOR_PID"} <= defined


def test_stage_files_are_written_atomically_and_read_back_typed(tmp_path):
    files.write_result(tmp_path, files.RuntimeResult(status=Status.PREEMPTED, exit_code=75, steps_done=7))
    assert files.read_result(tmp_path).status is Status.PREEMPTED
    files.write_last_words(tmp_path, files.LastWords(rank=1, cause="oom", error="x", time=2.0, exit_code=1))
    assert [w.cause for w in files.read_last_words(tmp_path)] == ["oom"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # no temporary files left behind
    (tmp_path / "heartbeat.rank0.json").write_text('{"step": 3, "ti')  # a writer killed mid-write (not ours)
    assert files.read_heartbeats(tmp_path) == {}
    files.append_progress(tmp_path, {"step": 5, "val_loss": 1.0})
    follower = files.ProgressFollower(tmp_path)
    assert follower.new() == [{"step": 5, "val_loss": 1.0}] and follower.new() == []


def test_the_digits_recipe_reads_the_same_data_as_scikit_learn_without_importing_it():
    import subprocess
    import sys

    import numpy as np
    from sklearn.datasets import load_digits

    from traingate.recipes.digits import _read_digits

    images, target = _read_digits()
    d = load_digits()
    assert np.array_equal(images, d.images) and np.array_equal(target, d.target)
    code = ("import sys; from traingate.recipes.digits import _read_digits; _read_digits(); "
            "sys.exit(1 if 'sklearn' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "reading digits imported scikit-learn"
