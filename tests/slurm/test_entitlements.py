"""Entitlements on a Slurm pool are Slurm's associations: traingate reads them before it creates anything.

The submitting user's associations (`sacctmgr show assoc user=...`) must grant the spec's team as an account and
its priority class as a QOS; otherwise the run is refused in one line naming the account or QOS and the fix, with
no MLflow run, no stage directory and no Slurm job behind it. The test users (tests/slurm/cluster.py): tgalice is
in account vision with QOS research and production; tgbob in account language with research only.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml
from slurm.test_engine import POOL, POOLS, slurm_pools  # noqa: F401 (a fixture)
from tgtest import TINY_DIGITS

from traingate.capacity import slurm as tslurm
from traingate.capacity.pools import parse_config


# The preflight as a user runs it: this process's user is the submitting one.
CHECK = """
import json, sys
from traingate.capacity import slurm_cli
from traingate.capacity.pools import parse_config
from traingate.capacity.slurm import SlurmError
config = parse_config(json.loads(sys.argv[3]))
try:
    slurm_cli.check_pool_entitled(config, sys.argv[4], sys.argv[1], sys.argv[2])
except SlurmError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
print("entitled")
"""


def _check_as(cluster, user: str, team: str, priority: str) -> subprocess.CompletedProcess:
    argv = [str(cluster.user_python), "-c", CHECK, team, priority, json.dumps(POOLS), POOL]
    return cluster.users[user].run(argv, timeout=60)


_LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def _tg_jobs() -> list:
    """traingate's live jobs (squeue also lists jobs of earlier tests that ended less than MinJobAge ago)."""
    out = subprocess.run(["squeue", "--json"], capture_output=True, text=True).stdout
    return [q for q in tslurm.queued_jobs(out) if q.name.startswith("tg-") and q.state in _LIVE]


def test_a_user_outside_the_teams_account_is_refused_in_one_line_naming_the_account_and_the_fix(slurm):
    r = _check_as(slurm, "tgbob", "vision", "research")
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.count("\n") == 1, r.stderr
    assert "no association with account 'vision'" in r.stderr and "identity.team = 'vision'" in r.stderr
    assert "tgbob's accounts: language" in r.stderr and "sacctmgr add user tgbob account=vision" in r.stderr


def test_a_qos_the_association_does_not_grant_is_refused_in_one_line_naming_the_qos_and_the_fix(slurm):
    r = _check_as(slurm, "tgbob", "language", "urgent")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r
    assert "may not use QOS 'urgent' on account 'language'" in r.stderr and "granted: research" in r.stderr
    assert "resources.priority = 'urgent'" in r.stderr and "set qos+=urgent" in r.stderr


def test_a_member_with_a_granted_qos_passes_the_preflight(slurm):
    r = _check_as(slurm, "tgalice", "vision", "production")
    assert (r.returncode, r.stdout.strip()) == (0, "entitled"), r
    assert _check_as(slurm, "tgbob", "language", "research").returncode == 0


def test_a_local_pool_is_not_asked_about_slurm_associations(slurm):
    from traingate.capacity import slurm_cli

    local = parse_config({"pools": {"cpu": {"gpu": "none", "gpus_per_node": 2, "nodes": 1,
                                            "price_per_gpu_hour": 0.0, "worker": "process"}}})
    slurm_cli.check_pool_entitled(local, "cpu", "nosuch", "urgent")  # the local engine's own rules hold there
    slurm_cli.check_pool_entitled(None, POOL, "nosuch", "urgent")  # no capacity config: no Slurm pool


def test_a_refused_ladder_leaves_no_mlflow_run_no_stage_directory_and_no_slurm_job(slurm, slurm_pools, state_dir,
                                                                                  tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import pipeline
    from traingate.settings import Settings

    tree = yaml.safe_load(TINY_DIGITS)
    tree["identity"]["team"] = "robotics"  # no such account: this process's user (root) is not in it
    tree["resources"] = {"work_pool": POOL, "nodes": 1, "procs_per_node": 2}
    tree["pools"] = {POOL: {"price_per_gpu_hour": 1.0, "gpus_per_node": 2}}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tree))
    state = pipeline(str(spec), [], "full", return_state=True)
    assert state.is_failed(), state
    said = state.message or ""
    assert said.startswith("Slurm user 'root' has no association"), said  # the line itself, no exception wrapper
    print(f"\nrefused ladder: {said}")
    assert "no association with account 'robotics'" in said and "identity.team = 'robotics'" in said, said
    assert "sacctmgr add user root account=robotics" in said and "\n" not in said, said
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())
    experiment = MlflowClient(Settings.from_env().tracking_uri).get_experiment_by_name(tree["identity"]["experiment"])
    assert experiment is None or not MlflowClient(Settings.from_env().tracking_uri).search_runs(
        [experiment.experiment_id])
    assert _tg_jobs() == []


def test_traingate_run_refuses_a_team_the_user_is_not_in_before_any_flow_run_in_one_line(
        slurm, slurm_pools, prefect_api, state_dir, tmp_path):
    import os

    from prefect import get_client
    from tgtest import PYTHON

    tree = yaml.safe_load(TINY_DIGITS)
    tree["identity"]["team"] = "robotics"
    tree["resources"] = {"work_pool": POOL, "nodes": 1, "procs_per_node": 2}
    tree["pools"] = {POOL: {"price_per_gpu_hour": 1.0, "gpus_per_node": 2}}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tree))
    with get_client(sync_client=True) as c:
        before = len(c.read_flow_runs())
    env = {**os.environ, **prefect_api, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    r = subprocess.run([str(Path(PYTHON).parent / "traingate"), "run", str(spec)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no association with account 'robotics'" in r.stderr and "sacctmgr add user root" in r.stderr, r.stderr
    with get_client(sync_client=True) as c:
        assert len(c.read_flow_runs()) == before  # no flow run was created
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())
    assert _tg_jobs() == []
