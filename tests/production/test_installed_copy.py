"""Models from an installed, git-less copy of the code (as the training image holds it): promotable
with the version stamped at build, every artifact and the model in the configured S3 store; and,
without a stamp, a pipeline whose refused promotion says so in its final state and its artifact."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import boto3
import pytest
from mlflow.tracking import MlflowClient

from tgtest import PYTHON, ROOT, TINY_DIGITS
from traingate.tracking.identity import code_version
from traingate.tracking.stamp import read_stamp

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def install(tmp_path_factory, prefect_api):
    """The working tree copied as an install leaves it (no .git), and a Prefect server whose records outlive a run
    (the session's: what is installed is the subject, not the server)."""
    tmp = tmp_path_factory.mktemp("installed")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    copy = tmp / "opt-traingate"
    for f in sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()}):
        (copy / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, copy / f)
    (tmp / "tiny.yaml").write_text(TINY_DIGITS)
    server = {"url": prefect_api["PREFECT_API_URL"], "env": {"PREFECT_HOME": str(tmp / "prefect-home")}}
    return {"code": copy, "spec": tmp / "tiny.yaml", "server": server, "tmp": tmp}


def _run(install, state: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGATE_", "MLFLOW_"))}
    env.update(PYTHONPATH=str(install["code"]), TRAINGATE_STATE_DIR=str(state),
               PREFECT_API_URL=install["server"]["url"], PREFECT_HOME=install["server"]["env"]["PREFECT_HOME"],
               **extra)
    return subprocess.run([PYTHON, "-m", "flows.cli", "run", str(install["spec"])], cwd=install["code"], env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _pipeline_run(client: MlflowClient):
    exp = client.get_experiment_by_name("tests")
    (run,) = client.search_runs([exp.experiment_id], "tags.`traingate.kind` = 'pipeline'")
    return exp, run


@pytest.mark.timeout(1200)
def test_a_git_less_install_with_a_build_stamp_is_promotable_and_every_artifact_lands_in_s3(install, s3_server, tmp_path):
    stamp = subprocess.run([PYTHON, "-m", "traingate.tracking.stamp", "--from-git", str(ROOT), "--into",
                            str(install["code"])], capture_output=True, text=True, timeout=60)
    assert stamp.returncode == 0, stamp.stderr
    assert not (install["code"] / ".git").exists()
    state = tmp_path / "state"
    p = _run(install, state, TRAINGATE_ARTIFACT_URI="s3://tg-test/mlartifacts",
             TRAINGATE_CHECKPOINT_URI="s3://tg-test/checkpoints", TRAINGATE_S3_ENDPOINT_URL=s3_server["endpoint"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "pipeline PASSED: all 4 stages passed; model promoted: models:/tests-digits-cnn@candidate (version 1)" \
        in p.stdout, p.stdout

    client = MlflowClient(f"sqlite:///{state}/mlflow.db")
    exp, run = _pipeline_run(client)
    here = read_stamp(install["code"])  # ROOT's version when stamped (others keep editing ROOT meanwhile)
    assert here["sha"] == code_version(ROOT)["sha"]
    assert (run.data.tags["traingate.code_version"], run.data.tags["traingate.code_dirty"],
            run.data.tags["traingate.code_diff_hash"], run.data.tags["traingate.code_source"]) == \
        (here["sha"], here["dirty"], here["diff_hash"], "stamp")
    assert run.data.tags["traingate.identity_valid"] == "true"
    assert exp.artifact_location == "s3://tg-test/mlartifacts/tests"
    stages = {r.data.tags["traingate.stage"]: r for r in client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")}
    (version,) = client.search_model_versions("name = 'tests-digits-cnn'")
    assert version.run_id == stages["full"].info.run_id

    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="tg-test")
            for o in page.get("Contents", [])]
    assert f"mlartifacts/tests/{stages['canary'].info.run_id}/artifacts/gate/report.md" in keys
    models = [k for k in keys if k.endswith("/MLmodel")]
    # MLflow 3 keeps a logged model under the experiment's location: <location>/models/<model id>/artifacts/.
    assert [f"models:/{k.split('/')[-3]}" for k in models] == [version.source], (models, version.source)
    assert models[0].startswith("mlartifacts/tests/models/")
    assert any(k.startswith(f"checkpoints/{run.info.run_id}/") for k in keys)
    # Nothing of MLflow's on this machine's disk: no artifact dir in the state dir, no mlruns anywhere.
    local = [str(p) for root in (state, install["code"]) for p in root.rglob("*")
             if p.name in ("mlartifacts", "mlruns", "MLmodel")]
    assert local == []


@pytest.mark.timeout(1200)
def test_a_pipeline_whose_promotion_was_refused_says_so_in_its_final_state_and_artifact(install, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    (install["code"] / "traingate" / "_build.py").unlink(missing_ok=True)  # a copy nobody stamped
    state = tmp_path / "state"
    p = _run(install, state)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("pipeline "))
    assert line.startswith("pipeline PASSED: all 4 stages passed; not promoted: no code version - run from a git "
                           "checkout"), line
    _, run = _pipeline_run(MlflowClient(f"sqlite:///{state}/mlflow.db"))
    assert run.data.tags["traingate.code_source"] == "none"
    flow_run_id = next(x.split(":", 1)[1].strip() for x in p.stdout.splitlines() if "prefect flow run:" in x)
    with temporary_settings(updates={PREFECT_API_URL: install["server"]["url"]}), get_client(sync_client=True) as c:
        state_of_run = c.read_flow_run(flow_run_id).state
        (artifact,) = c.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"tg-{run.info.run_id}-5-promotion"])))
    assert state_of_run.is_completed() and "not promoted: no code version - " in state_of_run.message
    assert "not promoted: no code version - " in artifact.data
    assert "- identity incomplete: traingate.code_version" in artifact.data  # what the checks found, each
