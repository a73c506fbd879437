"""Unmodified scripts as first-class jobs, end to end under the real supervisor: killed mid-full (SIGKILL of
the script's process, as when a worker is lost), restarted through the script's own resume flag, finished;
its checkpoints indexed, uploaded (moto S3) and the newest registered in a real MLflow sqlite store.

The scripts under projects/ are written as their users would, knowing nothing of traingate; each test
copies one into a temp dir (so it has no git, and gets a content-hash code version).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
import yaml

from traingate.ladder import outcomes
from traingate.ladder.gates import decide
from traingate.job.files import STDOUT
from traingate.job.stagejob import StageJob, derive
from traingate.job.vocab import Cause, Status
from traingate.recipes import script as script_recipe
from traingate.settings import Settings
from traingate.spec import parse_spec
from traingate.supervision.supervisor import Hooks, Supervision, read_state, supervise
from traingate.tracking import runs
from traingate.tracking.identity import environment_snapshot, run_code_version
from traingate.promotion.aliases import model_name
from traingate.promotion.register import register_candidate
from traingate.ladder.preflight import check_spec

PROJECTS = Path(__file__).resolve().parent / "projects"
# The JSON-lines script with ckpt_000040.pt files and --resume-from-latest is the shipped example.
JSONL_LATEST = Path(__file__).resolve().parents[2] / "examples" / "script_project2"


def copy_project(tmp_path: Path, source: Path) -> Path:
    dest = tmp_path / "project"
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def script_spec(workdir: Path, script: dict[str, Any], **sections: Any) -> Any:
    tree = {"identity": {"experiment": "scripts", "owner": "tester", "team": "platform",
                         "purpose": "an unmodified script taken up the ladder"},
            "recipe": {"name": "script", "script": {"workdir": str(workdir), **script}},
            "resources": {"work_pool": "cpu-local", "procs_per_node": 1},
            "supervision": {"backoff_base_s": 0, "backoff_max_s": 0, "hang_timeout_s": 20, "max_restarts": 3},
            **sections}
    spec = parse_spec(tree)
    check_spec(spec)
    return spec


class Killer:
    """Kills the script's process with SIGKILL (a lost worker) once, when its output shows ``at`` and
    ``has_checkpoint()`` holds; records which checkpoint step existed at that moment."""

    def __init__(self, at: re.Pattern[str], newest_step: Callable[[], int | None]):
        self.at, self.newest_step = at, newest_step
        self.killed_pid: int | None = None
        self.step_at_kill: int | None = None
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if self.killed_pid is not None or not self.at.search(line) or self.newest_step() is None:
            return
        mine = [p for p in psutil.Process().children(recursive=True)
                if any(a.endswith("train.py") for a in p.cmdline())]
        assert len(mine) == 1, mine
        # Stopped before the newest checkpoint is read, so what it wrote is what the restart finds.
        # The script may be a few steps past ``at`` by now (a loaded box reads its output late):
        # the tests check the resume against the checkpoint it had, not a fixed step.
        os.kill(mine[0].pid, signal.SIGSTOP)
        self.step_at_kill = self.newest_step()
        self.killed_pid = mine[0].pid
        os.kill(self.killed_pid, signal.SIGKILL)


class Tracked:
    """A pipeline run with the script's full identity and its full stage's run, in the test's MLflow store."""

    def __init__(self, spec: Any):
        from tasks.data import data_snapshot  # the ladder's own data boundary (a Prefect task, called as a function)

        self.settings = Settings.from_env()
        self.client = runs.client(self.settings.tracking_uri)
        data_hash, data_uri = data_snapshot.fn(spec)
        self.identity = {"code": run_code_version(spec, self.settings.state_dir), "data_snapshot": data_hash,
                         "data_uri": data_uri, "environment": environment_snapshot()}
        key = uuid.uuid4().hex
        self.run_id = runs.open_pipeline_run(self.client, spec, self.settings.artifact_uri, self.identity,
                                             request_key=f"pipeline-{key}")
        self.stage_run = runs.open_stage_run(self.client, self.run_id, "full", request_key=f"full-{key}")

    def job(self, spec: Any) -> StageJob:
        return derive(spec, "full", run_id=self.run_id, run_dir=self.settings.state_dir / "runs" / self.run_id,
                      settings=self.settings, mlflow_run_id=self.stage_run)

    def promote(self, spec: Any, job: StageJob, sup: Supervision, seconds: float) -> dict[str, Any]:
        result = outcomes.from_supervision(job, sup, seconds)
        decision = decide(result, spec.gate("full"))
        assert decision.passed, decision.reasons
        runs.record_stage(self.client, self.stage_run, result, decision)
        # The stage's result names the checkpoint URI the script's declared files were published to.
        assert result.checkpoint_uri == job.checkpoint_uri
        return register_candidate(self.client, spec, self.stage_run, result.checkpoint_uri)

    def registered_file(self, spec: Any, version: str) -> Path:
        import mlflow

        mlflow.set_tracking_uri(self.client.tracking_uri)
        folder = Path(mlflow.artifacts.download_artifacts(f"models:/{model_name(spec)}/{version}"))
        files = list(folder.iterdir())
        assert len(files) == 1, files
        return files[0]


def supervised(job: StageJob, on_line: Callable[[str], None] | None = None, **kw: Any) -> tuple[Supervision, list, list, float]:
    log: list[str] = []
    events: list[dict[str, Any]] = []
    t0 = time.monotonic()
    sup = supervise(job, Hooks(on_line=on_line, info=log.append, on_restart=events.append), seed=0, **kw)
    return sup, log, events, time.monotonic() - t0


def newest_ckpt_step(ckpt_dir: Path) -> int | None:
    last = script_recipe.newest(script_recipe.index_checkpoints(ckpt_dir, "ckpt_*.pt"))
    return last.step if last is not None else None


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


TORCH_SCRIPT = {
    "command": ["python", "train.py", "--out", "${TRAINGATE_CHECKPOINT_DIR}", "--sleep", "0.05"],
    "stage_args": {"full": ["--steps", "60"]},
    "resume_args": ["--resume", "${TRAINGATE_CHECKPOINT_DIR}/last.pt"],
    "checkpoints": "last.pt",
    "metrics": [r"epoch \d+ step (?P<step>\d+) \| loss (?P<loss>[0-9.eE+-]+|nan|inf)"],
}


@pytest.mark.slow
def test_torch_script_killed_mid_full_resumes_through_its_resume_flag_and_its_checkpoint_is_registered(
        tmp_path, state_dir):
    workdir = copy_project(tmp_path, PROJECTS / "torch_resume")
    spec = script_spec(workdir, TORCH_SCRIPT, data={"uri": (workdir / "data").as_uri()})
    tracked = Tracked(spec)
    assert tracked.identity["code"]["source"] == "content"  # a git-less project: still a complete identity
    job = tracked.job(spec)
    ckpt_dir = Path(job.checkpoint_dir)
    assert job.checkpoint_uri == ckpt_dir.as_uri()  # a local checkpoint URI is the script's dir itself

    def newest_step() -> int | None:
        import torch

        return torch.load(ckpt_dir / "last.pt")["step"] if (ckpt_dir / "last.pt").exists() else None
    killer = Killer(re.compile(r"step 25 \|"), newest_step)
    sup, log, events, seconds = supervised(job, killer)

    assert sup.status == Status.COMPLETED, sup.error
    assert [a.cause for a in sup.attempts] == [Cause.WORKER_LOST, None]
    k = killer.step_at_kill  # 20 unless the kill landed past step 30 (it saves every 10)
    assert k is not None and 20 <= k < 60 and k % 10 == 0, k
    launches = [line for line in log if ": launch " in line]
    assert "--resume" not in launches[0] and f"--resume {ckpt_dir}/last.pt" in launches[1]
    assert events[0]["cause"] == "worker_lost" and events[0]["failed_at_step"] >= 25
    second = killer.lines[killer.lines.index(f"=> resumed from {ckpt_dir}/last.pt (step {k})"):]
    assert second[1].startswith(f"epoch {k // 20 + 1} step {k + 1} |")  # not from step 0
    assert killer.lines[-1] == "done" and "epoch 3 step 60 |" in killer.lines[-2]

    out = tracked.promote(spec, job, sup, seconds)
    assert out["registered"], out
    [entry] = script_recipe.read_index(job.checkpoint_uri)
    assert (entry.path, entry.size, entry.sha256) == ("last.pt", (ckpt_dir / "last.pt").stat().st_size,
                                                      sha256(ckpt_dir / "last.pt"))
    got = tracked.registered_file(spec, out["version"])
    assert got.name == "last.pt" and sha256(got) == entry.sha256
    import torch

    assert torch.load(got)["step"] == 60
    version = tracked.client.get_model_version(model_name(spec), out["version"])
    assert version.tags["traingate.code_version"] == tracked.identity["code"]["sha"]
    assert tracked.identity["code"]["sha"].startswith("sha256:")
    assert version.tags["traingate.data_snapshot"].startswith("dir-")
    assert tracked.client.get_registered_model(model_name(spec)).aliases == {"candidate": out["version"]}


@pytest.mark.slow
def test_jsonl_script_killed_mid_full_resumes_from_its_latest_ckpt_and_its_checkpoints_are_uploaded_to_s3(
        tmp_path, state_dir, s3_server):
    import boto3

    workdir = copy_project(tmp_path, JSONL_LATEST)
    script = {
        "command": ["python", "train.py", "--ckpt-dir", "${TRAINGATE_CHECKPOINT_DIR}", "--sleep", "0.03"],
        "stage_args": {"full": ["--max-steps", "100"]},
        "resume_args": ["--resume-from-latest"],
        "checkpoints": "ckpt_*.pt",
        "metrics": [r'"step": (?P<step>\d+), "loss": (?P<loss>[0-9.eE+-]+)'],
    }
    spec = script_spec(workdir, script, data={"uri": (workdir / "data.csv").as_uri()},
                       checkpoint={"uri": "s3://tg-test/ckpts"})
    tracked = Tracked(spec)
    job = tracked.job(spec)
    assert job.checkpoint_uri.startswith("s3://tg-test/ckpts/")
    ckpt_dir = Path(job.checkpoint_dir)
    assert ckpt_dir == Path(job.stage_dir) / "checkpoints"  # S3 is traingate's to write; the script writes here

    killer = Killer(re.compile(r'"step": 45,'), lambda: newest_ckpt_step(ckpt_dir))
    sup, log, events, seconds = supervised(job, killer)

    assert sup.status == Status.COMPLETED, sup.error
    assert [a.cause for a in sup.attempts] == [Cause.WORKER_LOST, None]
    k = killer.step_at_kill  # 40 unless the kill landed past step 60
    assert k is not None and 40 <= k < 100 and k % 20 == 0, k
    assert events[0]["resume_from_step"] == k
    text = (Path(job.stage_dir) / STDOUT).read_text()
    assert f"resuming from {ckpt_dir}/ckpt_{k:06d}.pt at step {k}" in text
    steps = [json.loads(line)["step"] for line in text.splitlines() if line.startswith("{")]
    first, again = [i for i, step in enumerate(steps) if step == k + 1]  # the second launch starts after k
    assert steps[:again] == list(range(1, again + 1)) and steps[again - 1] >= 45
    assert steps[again:] == list(range(k + 1, 101))

    # Uploaded: what the script keeps (its own retention: the last two), and the index; what it deleted is gone.
    prefix = job.checkpoint_uri.removeprefix("s3://tg-test/")
    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    keys = sorted(o["Key"].removeprefix(prefix + "/") for o in s3.list_objects_v2(Bucket="tg-test", Prefix=prefix)["Contents"])
    assert keys == [".traingate-index.json", "ckpt_000080.pt", "ckpt_000100.pt"]
    index = script_recipe.read_index(job.checkpoint_uri)
    assert [(c.path, c.step) for c in index] == [("ckpt_000080.pt", 80), ("ckpt_000100.pt", 100)]
    body = s3.get_object(Bucket="tg-test", Key=f"{prefix}/ckpt_000100.pt")["Body"].read()
    assert hashlib.sha256(body).hexdigest() == index[-1].sha256

    out = tracked.promote(spec, job, sup, seconds)
    assert out["registered"], out
    got = tracked.registered_file(spec, out["version"])
    assert got.name == "ckpt_000100.pt" and json.loads(got.read_text())["step"] == 100
    version = tracked.client.get_model_version(model_name(spec), out["version"])
    assert (version.tags["traingate.checkpoint_step"], version.tags["traingate.checkpoint_sha256"]) == \
        ("100", index[-1].sha256)


@pytest.mark.slow
def test_a_script_stage_stopped_after_a_kill_continues_with_traingate_resume_through_its_resume_flag(
        tmp_path, state_dir):
    workdir = copy_project(tmp_path, JSONL_LATEST)
    script = {"command": ["python", "train.py", "--ckpt-dir", "${TRAINGATE_CHECKPOINT_DIR}", "--sleep", "0.05"],
              "stage_args": {"full": ["--max-steps", "60"]}, "resume_args": ["--resume-from-latest"],
              "checkpoints": "ckpt_*.pt", "metrics": [r'"step": (?P<step>\d+), "loss": (?P<loss>[0-9.eE+-]+)']}
    spec = script_spec(workdir, script, supervision={"max_restarts": 0, "backoff_base_s": 0},
                       tracking={"enabled": False})
    job = derive(spec, "full", run_id="r1", run_dir=tmp_path / "runs" / "r1", settings=Settings.from_env())
    ckpt_dir = Path(job.checkpoint_dir)
    killer = Killer(re.compile(r'"step": 25,'), lambda: newest_ckpt_step(ckpt_dir))
    first, *_ = supervised(job, killer)
    assert first.status == Status.FAILED and first.cause == Cause.WORKER_LOST  # no restarts left

    # `traingate resume` hands the stage's earlier supervision in: the next launch is a restart.
    second, log, _, _ = supervised(job, resumed=read_state(Path(job.stage_dir)))
    assert second.status == Status.COMPLETED, second.error
    assert "--resume-from-latest" in [line for line in log if ": launch " in line][0]
    text = (Path(job.stage_dir) / STDOUT).read_text()
    k = killer.step_at_kill
    assert k in (20, 40), k
    assert f"resuming from {ckpt_dir}/ckpt_{k:06d}.pt at step {k}" in text


@pytest.mark.slow
def test_a_script_that_stops_printing_is_killed_as_hung_and_restarted(tmp_path, state_dir):
    workdir = copy_project(tmp_path, PROJECTS / "hangs_once")
    spec = script_spec(workdir, {"command": ["python", "train.py", "${TRAINGATE_STAGE_DIR}"],
                                 "metrics": [r"step (?P<step>\d+) loss (?P<loss>[0-9.]+)"]},
                       supervision={"hang_timeout_s": 2, "backoff_base_s": 0}, tracking={"enabled": False})
    job = derive(spec, "full", run_id="h1", run_dir=tmp_path / "runs" / "h1", settings=Settings.from_env())
    t0 = time.monotonic()
    sup, log, events, _ = supervised(job)
    assert sup.status == Status.COMPLETED, sup.error
    assert [a.cause for a in sup.attempts] == [Cause.HANG, None]
    assert "printed no new metric step for" in sup.attempts[0].detail and "after metric step 3" in sup.attempts[0].detail
    assert sup.attempts[0].end_step == 3 and events[0]["cause"] == "hang"
    assert time.monotonic() - t0 < 15  # the 3600 s sleep was cut at the 2 s hang timeout


@pytest.mark.slow
def test_a_script_without_metric_steps_is_watched_by_its_output_lines(tmp_path, state_dir):
    workdir = copy_project(tmp_path, PROJECTS / "hangs_once")
    spec = script_spec(workdir, {"command": ["python", "train.py", "${TRAINGATE_STAGE_DIR}"]},
                       supervision={"hang_timeout_s": 1.5, "backoff_base_s": 0}, tracking={"enabled": False},
                       gates={"canary": {"rules": [{"metric": "nonfinite_steps", "op": "==", "value": 0}]}})
    job = derive(spec, "full", run_id="h2", run_dir=tmp_path / "runs" / "h2", settings=Settings.from_env())
    sup, *_ = supervised(job)
    assert [a.cause for a in sup.attempts] == [Cause.HANG, None]
    assert "printed no new output line for" in sup.attempts[0].detail and "after output line 3" in sup.attempts[0].detail


def test_a_script_that_declares_no_checkpoints_is_still_refused_promotion_with_its_reason(tmp_path, state_dir):
    from traingate.job.result import StageResult

    workdir = copy_project(tmp_path, JSONL_LATEST)
    spec = script_spec(workdir, {"command": ["python", "train.py", "--ckpt-dir", "${TRAINGATE_CHECKPOINT_DIR}"],
                                 "metrics": [r'"step": (?P<step>\d+), "loss": (?P<loss>[0-9.eE+-]+)']},
                       data={"uri": (workdir / "data.csv").as_uri()})
    tracked = Tracked(spec)
    result = StageResult(stage="full", status=Status.COMPLETED, metrics={"nonfinite_steps": 0.0, "steps": 80.0})
    decision = decide(result, spec.gate("full"))
    runs.record_stage(tracked.client, tracked.stage_run, result, decision)
    out = register_candidate(tracked.client, spec, tracked.stage_run, None)
    assert out == {"registered": False, "reasons": [
        "no model checkpoint: the script declares no recipe.script.checkpoints, so traingate does not know which "
        "file is its model (script recipes register their own models)"]}  # identity complete: only this reason
    # Declared, but nothing written under the checkpoint URI: refused with that reason, not an error.
    declared = spec.model_copy(deep=True)
    declared.recipe.script.checkpoints = "ckpt_*.pt"
    empty = (tmp_path / "empty").as_uri()
    out = register_candidate(tracked.client, declared, tracked.stage_run, empty)
    assert out["reasons"] == [f"no model checkpoint: the script wrote no file matching recipe.script.checkpoints "
                              f"('ckpt_*.pt') under {empty}"]
    assert not tracked.client.search_registered_models()


def test_a_script_run_without_data_uri_is_refused_promotion_in_one_line_naming_data_uri_as_the_fix(tmp_path, state_dir):
    from traingate.job.result import StageResult
    from traingate.promotion.refusal import refusal

    workdir = copy_project(tmp_path, JSONL_LATEST)
    spec = script_spec(workdir, {"command": ["python", "train.py", "--ckpt-dir", "${TRAINGATE_CHECKPOINT_DIR}"],
                                 "metrics": [r'"step": (?P<step>\d+), "loss": (?P<loss>[0-9.eE+-]+)'],
                                 "checkpoints": "ckpt_*.pt"})  # no data: section
    tracked = Tracked(spec)
    result = StageResult(stage="full", status=Status.COMPLETED, metrics={"nonfinite_steps": 0.0, "steps": 80.0})
    runs.record_stage(tracked.client, tracked.stage_run, result, decide(result, spec.gate("full")))
    out = register_candidate(tracked.client, spec, tracked.stage_run, (tmp_path / "ck").as_uri())
    assert not out["registered"] and len(out["reasons"]) == 4  # data snapshot and URI, on the stage and pipeline runs
    assert refusal(out["reasons"]) == (
        "not promoted: no data snapshot - set data.uri (the file or directory the script trains on; its content hash "
        "is the snapshot)"
    )
