"""An unmodified script up the whole ladder (real Prefect test harness, real MLflow sqlite store): a git-less
copy of examples/script_project2 gets a content-hash code version, its data.uri the data snapshot, and its
final declared checkpoint, published by traingate, is the registered model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from uuid import UUID

import pytest
from mlflow.tracking import MlflowClient

from tgtest import ROOT
from traingate.settings import Settings

pytestmark = pytest.mark.slow


def test_a_git_less_script_project_climbs_the_ladder_and_its_final_checkpoint_is_the_registered_model(
        prefect_harness, state_dir, tmp_path):
    import mlflow

    from flows.pipeline import pipeline

    project = tmp_path / "project"
    shutil.copytree(ROOT / "examples" / "script_project2", project, ignore=shutil.ignore_patterns("__pycache__"))
    overrides = [f"data.uri={(project / 'data.csv').as_uri()}",
                 "recipe.script.stage_args.full=[--max-steps, '60']"]
    state = pipeline(str(project / "spec.yaml"), overrides, "full", return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["model"]["registered"], summary["model"]
    # A stage's recording runs beside the next stage from that stage's launch on, not beside its start.
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    with get_client(sync_client=True) as c:
        ours = FlowRunFilter(id=FlowRunFilterId(any_=[UUID(summary["flow_run_id"])]))
        started = {t.name: t.start_time.timestamp() for t in c.read_task_runs(flow_run_filter=ours) if t.start_time}
    for stage, nxt in [("unit", "smoke"), ("smoke", "canary"), ("canary", "full")]:
        attempts = json.loads((Path(summary["run_dir"]) / nxt / "supervisor.json").read_text())["attempts"]
        assert started[f"record-{stage}"] >= attempts[0]["launched_at"], (stage, started, attempts[0]["launched_at"])
    client = MlflowClient(Settings.from_env().tracking_uri)
    version = client.get_model_version(summary["model"]["name"], summary["model"]["version"])
    assert version.tags["traingate.code_version"].startswith("sha256:")
    assert version.tags["traingate.data_snapshot"] not in ("", "undeclared")
    mlflow.set_tracking_uri(client.tracking_uri)
    folder = mlflow.artifacts.download_artifacts(f"models:/{summary['model']['name']}/{version.version}",
                                                 dst_path=str(tmp_path / "model"))
    assert [p.name for p in Path(folder).iterdir()] == ["ckpt_000060.pt"]  # the script checkpoints every 20 steps
