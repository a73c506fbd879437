"""A training stage's progress artifact on the session's real Prefect server, fed by a stage directory
written as a training process writes it (job.json, supervisor.json, metrics.jsonl): no training needed."""
from __future__ import annotations

import dataclasses
import math
import time

import pytest

from tgtest import TINY_DIGITS
from traingate.job import files
from traingate.job.stagejob import JobKind, derive
from traingate.settings import Settings
from traingate.spec import load_spec


def _job(tmp_path, monkeypatch, kind=JobKind.LADDER):
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "spec.yaml").write_text(TINY_DIGITS)
    run_dir = tmp_path / "state" / "runs" / f"r{time.time_ns()}"
    (run_dir / "canary").mkdir(parents=True)
    job = derive(load_spec(tmp_path / "spec.yaml"), "canary", run_id=run_dir.name, run_dir=run_dir,
                 settings=Settings.from_env(), mlflow_run_id="ab12cd", kind=kind)
    job = dataclasses.replace(job, tracking_uri="http://svc:s3cret@mlflow.internal:5000", launched_at=time.time())
    job.write()
    files.write_supervisor_state(run_dir / "canary", files.SupervisorState(job={"stage": "canary"}))
    return job, run_dir / "canary"


def _steps(writer, first: int, last: int, t0: float) -> None:
    for s in range(first, last + 1):
        writer.write(files.StepMetrics(step=s, time=t0 + 0.5 * s, loss=2.0 / s, grad_norm=1.0, lr=0.05,
                                       step_time_s=0.5, data_wait_s=0.0))
    writer.f.flush()


@pytest.mark.filterwarnings("ignore:Artifact creation outside:FutureWarning")  # the task run is the stage's
def test_a_stage_progress_artifact_is_updated_in_place_with_steps_loss_eta_and_the_mlflow_link(
        prefect_harness, tmp_path, monkeypatch):
    from prefect import get_client
    from prefect.artifacts import Artifact
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.progress import ProgressArtifact

    job, stage_dir = _job(tmp_path, monkeypatch)
    writer = files.MetricsWriter(stage_dir)
    t0 = time.time()
    _steps(writer, 1, 5, t0)
    progress = ProgressArtifact(job)
    assert progress.publish() == 25.0  # 5 of the canary's 20 steps
    first = Artifact.get(progress.key)
    assert first is not None and math.isclose(float(first.data), 25.0)
    assert "**canary** running: step 5/20 (25%), loss 0.4, ETA 0:08" in first.description
    assert "MLflow run: [ab12cd](http://mlflow.internal:5000/#/runs/ab12cd)" in first.description
    assert "s3cret" not in first.description

    progress.tick()  # within the update interval: nothing is sent
    _steps(writer, 6, 20, t0)
    writer.close()
    files.write_supervisor_state(stage_dir, files.SupervisorState(job={"stage": "canary"}, final={"status": "completed"}))
    assert progress.publish() == 100.0
    last = Artifact.get(progress.key)
    assert last is not None and last.id == first.id and math.isclose(float(last.data), 100.0)
    assert "**canary** completed: step 20/20 (100%), loss 0.1," in last.description and "ETA" not in last.description
    with get_client(sync_client=True) as client:
        same_key = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[progress.key])))
    assert len(same_key) == 1  # updated in place, not a new version per update


def test_a_sweep_trial_publishes_no_stage_progress_artifact(prefect_harness, tmp_path, monkeypatch):
    from prefect.artifacts import Artifact

    from tasks.progress import ProgressArtifact

    job, _ = _job(tmp_path, monkeypatch, kind=JobKind.TRIAL)
    progress = ProgressArtifact(job)
    assert progress.publish() is None and Artifact.get(progress.key) is None
