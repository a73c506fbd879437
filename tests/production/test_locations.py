"""Where state lives on the production path: a pool's locations in its job template, flow runs that
refuse to write into their code directory, read-only commands that name their store and never
create an empty one, stamped code versions of git-less copies, experiments' artifact locations."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tgtest import PYTHON, ROOT, free_port
from traingate.capacity.pools import parse_config
from traingate.settings import LocationError, Settings, for_deployment, pool_locations, store_to_read
from traingate.tracking.identity import code_version, commit_mismatch
from traingate.tracking.runs import ArtifactLocationError, experiment_id
from traingate.tracking.stamp import StampError, read_stamp, write_stamp

POOLS = {"pools": {"cpu-local": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 0.05, "worker": "process"},
                   "gpu-a100": {"gpu": "A100-80GB", "gpus_per_node": 8, "nodes": 1, "price_per_gpu_hour": 2.5,
                                "worker": "docker"}}}


def _env_without_locations(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINGATE_", "MLFLOW_")) or k == "TRAINGATE_PREFECT_SERVER"}  # not a location
    return {**env, **extra}


def test_a_pools_flow_runs_get_the_bootstraps_locations_merged_with_the_deployments_env(prefect_harness):
    from prefect.workers.process import ProcessJobConfiguration

    from flows.cli.pools import job_template
    from flows.warm_engine import ENGINE_COMMAND

    cfg = parse_config(POOLS)
    env = {"TRAINGATE_STATE_DIR": "/srv/traingate", "TRAINGATE_TRACKING_URI": "http://mlflow:5000",
           "TRAINGATE_S3_ENDPOINT_URL": "http://minio:9000", "TRAINGATE_CHECKPOINT_URI": "s3://tg/ckpt",
           "HOME": "/root"}
    locations = pool_locations("gpu-a100", env)
    assert locations == {"TRAINGATE_STATE_DIR": "/srv/traingate", "TRAINGATE_TRACKING_URI": "http://mlflow:5000",
                         "TRAINGATE_CHECKPOINT_URI": "s3://tg/ckpt", "TRAINGATE_S3_ENDPOINT_URL": "http://minio:9000",
                         "MLFLOW_S3_ENDPOINT_URL": "http://minio:9000"}
    from prefect_docker.worker import DockerWorkerJobConfiguration

    template = job_template(cfg.pools["gpu-a100"], "ghcr.io/acme/train:1.2.3", "gpu-a100", locations, env)
    # What a worker computes for a flow run of a deployment with its own env job variables (prefect.yaml's NCCL).
    job = asyncio.run(DockerWorkerJobConfiguration.from_template_and_values(
        template, {"env": {"NCCL_ASYNC_ERROR_HANDLING": "1"}}))
    assert job.env == {**locations, "NCCL_ASYNC_ERROR_HANDLING": "1"}
    plain = asyncio.run(ProcessJobConfiguration.from_template_and_values(
        job_template(cfg.pools["cpu-local"], None, "cpu-local", locations), {}))
    assert plain.env == locations
    assert plain.command == ENGINE_COMMAND  # a process pool's flow runs start through flows/warm_engine.py


@pytest.mark.parametrize("state, why", [(None, "TRAINGATE_STATE_DIR is not set"), ("", "TRAINGATE_STATE_DIR is not set"),
                                        ("relative/state", "is not an absolute path")])
def test_pools_bootstrap_refuses_a_pool_without_an_absolute_state_dir_in_one_line(tmp_path, state, why, monkeypatch,
                                                                                  capsys):
    from flows.cli import main

    (tmp_path / "pools.yaml").write_text("pools:\n  cpu-local: {gpus_per_node: 2, nodes: 1, price_per_gpu_hour: 0, "
                                         "worker: process}\n")
    # In this process, with this environment's locations removed as in a fresh shell.
    for k in list(os.environ):
        if k not in _env_without_locations():
            monkeypatch.delenv(k)
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")  # nothing listens: never asked
    if state is not None:
        monkeypatch.setenv("TRAINGATE_STATE_DIR", state)
    monkeypatch.chdir(tmp_path)
    code = main(["pools", "bootstrap", str(tmp_path / "pools.yaml")])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("traingate pools: pool cpu-local: TRAINGATE_STATE_DIR"), err
    assert why in lines[0]


def test_a_flow_run_from_a_deployment_refuses_state_in_its_code_directory(tmp_path):
    with pytest.raises(LocationError, match=r"TRAINGATE_STATE_DIR is not set for this flow run: its state would go "
                                            rf"to {ROOT}/\.traingate, inside the code directory"):
        for_deployment({}, cwd=ROOT)
    with pytest.raises(LocationError, match=rf"resolves to {ROOT}/state, inside the code directory {ROOT};"):
        for_deployment({"TRAINGATE_STATE_DIR": str(ROOT / "state")}, cwd=tmp_path)
    assert for_deployment({"TRAINGATE_STATE_DIR": str(tmp_path / "s")}, cwd=ROOT).state_dir == tmp_path / "s"


@pytest.mark.parametrize("command", [["runs"], ["show", "0" * 32]], ids=["runs", "show"])
def test_read_only_commands_name_their_store_and_refuse_to_create_an_empty_one(tmp_path, command, monkeypatch,
                                                                               capsys):
    from flows.cli import main

    # In this process, with this environment's locations removed as in a fresh shell.
    for k in list(os.environ):
        if k not in _env_without_locations():
            monkeypatch.delenv(k)
    state = tmp_path / "somewhere-else"
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(state))
    monkeypatch.chdir(tmp_path)
    code = main(list(command))
    out, err = capsys.readouterr()
    db = state / "mlflow.db"
    assert code == 2, out + err
    assert err.splitlines() == [
        f"traingate {command[0]}: reading sqlite:///{db} (TRAINGATE_STATE_DIR={state})",
        f"traingate {command[0]}: no tracking store at {db}: {command[0]} reads the store your runs wrote; set "
        "TRAINGATE_STATE_DIR to their state directory (a pool's is in its job template: prefect work-pool inspect "
        "POOL) or TRAINGATE_TRACKING_URI to their tracking server"]
    assert not state.exists(), "a read-only command created a store"
    # The same command with no state dir set says it reads ./.traingate of the current directory.
    monkeypatch.delenv("TRAINGATE_STATE_DIR")
    code = main(list(command))
    err = capsys.readouterr().err
    assert code == 2 and f"(TRAINGATE_STATE_DIR unset: ./.traingate in {tmp_path})" in err.splitlines()[0], err
    assert not (tmp_path / ".traingate" / "mlflow.db").exists()


def test_a_read_only_command_reads_an_existing_store_and_says_which(tmp_path, capsys):
    state = tmp_path / "state"
    state.mkdir()
    MlflowClient(f"sqlite:///{state}/mlflow.db").search_experiments()  # a store, as a run leaves it
    capsys.readouterr()
    settings = store_to_read("runs", {"TRAINGATE_STATE_DIR": str(state)})
    assert settings.tracking_uri == f"sqlite:///{state}/mlflow.db"
    assert capsys.readouterr().err == f"traingate runs: reading sqlite:///{state}/mlflow.db (TRAINGATE_STATE_DIR={state})\n"
    store_to_read("show", {"TRAINGATE_TRACKING_URI": "http://user:secret-pw@mlflow:5000"})
    assert capsys.readouterr().err == "traingate show: reading http://user:***@mlflow:5000 (TRAINGATE_TRACKING_URI)\n"


def test_beside_a_tracking_server_artifacts_default_to_the_servers_store_not_this_disk(tmp_path):
    s = Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path), "TRAINGATE_TRACKING_URI": "http://mlflow:5000"})
    assert s.artifact_uri == "mlflow-artifacts:/"
    local = Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path)})
    assert local.artifact_uri == (tmp_path / "mlartifacts").as_uri()
    assert Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path), "TRAINGATE_TRACKING_URI": "http://mlflow:5000",
                              "TRAINGATE_ARTIFACT_URI": "s3://tg/art"}).artifact_uri == "s3://tg/art"


def test_an_experiment_that_stores_artifacts_elsewhere_is_refused_naming_both(tmp_path):
    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    first = experiment_id(c, "vision", (tmp_path / "art").as_uri())
    assert c.get_experiment(first).artifact_location == f"{(tmp_path / 'art').as_uri()}/vision"
    assert experiment_id(c, "vision", (tmp_path / "art").as_uri() + "/") == first
    with pytest.raises(ArtifactLocationError) as e:
        experiment_id(c, "vision", "s3://tg-prod/mlartifacts")
    assert str(e.value) == (f"experiment 'vision' stores its artifacts at {(tmp_path / 'art').as_uri()}/vision, but "
                            "TRAINGATE_ARTIFACT_URI puts them at s3://tg-prod/mlartifacts/vision; use a new "
                            f"identity.experiment, or set TRAINGATE_ARTIFACT_URI to {(tmp_path / 'art').as_uri()}")
    # a tracking server's own store places its experiments by id (its auth app reads who may write from it):
    # one stored elsewhere is refused the same way
    with pytest.raises(ArtifactLocationError, match=r"^experiment 'vision' stores its artifacts at file:.*, but "
                       r"TRAINGATE_ARTIFACT_URI puts them in the tracking server's store \(mlflow-artifacts:/\); "):
        experiment_id(c, "vision", "mlflow-artifacts:/")


def _installed_copy(dest: Path) -> Path:
    """The package as an install leaves it: the code, no .git."""
    shutil.copytree(ROOT / "traingate", dest / "traingate", ignore=shutil.ignore_patterns("__pycache__", "_build.py"))
    return dest


def test_a_git_less_copy_reads_the_version_stamped_when_it_was_built(tmp_path):
    copy = _installed_copy(tmp_path / "opt")
    assert code_version(copy) == {"sha": "unknown", "dirty": "unknown", "diff_hash": "", "source": "none"}
    sha = code_version(ROOT)["sha"]
    p = subprocess.run([PYTHON, "-m", "traingate.tracking.stamp", "--sha", sha, "--into", str(copy)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert code_version(copy) == {"sha": sha, "dirty": "false", "diff_hash": "", "source": "stamp"}
    # The image's build arg left empty: one line naming the build arg, nothing written.
    (copy / "traingate" / "_build.py").unlink()
    p = subprocess.run([PYTHON, "-m", "traingate.tracking.stamp", "--sha", "", "--dirty", "false", "--diff-hash", "",
                        "--into", str(copy)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--build-arg CODE_VERSION=$(git rev-parse HEAD)" in p.stderr
    assert read_stamp(copy) is None


def test_a_copy_inside_an_unrelated_git_repository_is_not_versioned_by_it(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    copy = _installed_copy(tmp_path / "venv" / "site-packages")
    assert code_version(copy)["source"] == "none"


def test_a_git_checkout_is_never_stamped_and_a_bad_stamp_is_refused(tmp_path):
    with pytest.raises(StampError, match="is a git checkout: its version is read from git"):
        write_stamp(ROOT, "a" * 40)
    copy = _installed_copy(tmp_path / "opt")
    with pytest.raises(StampError, match="a dirty tree needs the 16-hex hash of its diff"):
        write_stamp(copy, "a" * 40, "true", "")
    (copy / "traingate" / "_build.py").write_text("CODE_VERSION = {'sha': 'main', 'dirty': 'false'}\n")
    with pytest.raises(StampError, match=r"_build.py: malformed stamp \(--sha 'main' is not a full git commit sha"):
        code_version(copy)


def test_ci_refuses_code_that_is_not_the_commit_it_asked_for():
    here = code_version(ROOT)
    other = "f" * 40 if not here["sha"].startswith("f") else "e" * 40
    assert "was asked for, but the code here is" in commit_mismatch(other[:12], here)
    clean = {**here, "dirty": "false", "diff_hash": ""}
    assert commit_mismatch(here["sha"][:10], clean) is None
    assert commit_mismatch(here["sha"], {**clean, "dirty": "true"}).endswith(
        "(TRAINGATE_CI_REPOSITORY on the pool or worker)")
    assert commit_mismatch("HEAD", clean).startswith("commit = 'HEAD': pass a git commit sha")
