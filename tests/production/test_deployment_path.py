"""The deployment path as a platform team runs it: a real `prefect server start`, the pools bootstrap
writing the pool's locations, deployments of deployments/prefect.yaml made from a copy of the code,
and a process worker whose working directory is that copy and whose own environment names no
location. Then CI: the ci-canary deployment on two commits of a local git repository."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tgtest import PYTHON, ROOT, TINY_DIGITS, pool_worker, prefect_api_at, prefect_server, tail

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 600
MARKER = "[commit B] "


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _source_files() -> list[str]:
    """The working tree as a commit of it would hold it (tracked and untracked, not ignored, not deleted)."""
    out = _git(ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})


def _snapshot(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``d``, size and mtime, but bytecode caches (Python's own, ignored by git) and git's index
    (reading the code version, like `git status`, refreshes its cached file times; the content is unchanged)."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.relative_to(d) != Path(".git/index")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prodpath")
    # The CI repository: commit A is this working tree plus a tiny spec; commit B differs in the flow's code.
    repo = tmp / "repo"
    for f in _source_files():
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, repo / f)
    (repo / "ci-tiny.yaml").write_text(TINY_DIGITS)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "-c", "user.name=ci", "-c", "user.email=ci@example.com", "add", "-A")
    _git(repo, "-c", "user.name=ci", "-c", "user.email=ci@example.com", "commit", "-q", "-m", "A")
    a = _git(repo, "rev-parse", "HEAD")
    pipeline = repo / "flows" / "pipeline.py"
    old = "message = decision.summary()"  # the failed gate's message
    assert pipeline.read_text().count(old) == 1
    pipeline.write_text(pipeline.read_text().replace(old, f"message = {MARKER!r} + decision.summary()"))
    _git(repo, "-c", "user.name=ci", "-c", "user.email=ci@example.com", "commit", "-q", "-am", "B")
    b = _git(repo, "rev-parse", "HEAD")
    # The worker's code directory: a clean checkout of A, as a pull step or an image leaves it.
    code = tmp / "code"
    _git(tmp, "clone", "-q", str(repo), str(code))
    _git(code, "checkout", "-q", "--detach", a)

    snapshots: list[dict] = []
    with prefect_server(tmp) as server, pool_worker(
            tmp, server, code, ["ladder-cpu", "ci-canary"], worker_cwd=code,
            worker_env={"TRAINGATE_CI_REPOSITORY": str(repo)},
            before_worker=lambda: snapshots.append(_snapshot(code))) as pool:
        yield {"url": server["url"], "env": pool["env"], "code": code, "repo": repo, "a": a, "b": b,
               "before": snapshots[0], "pool_state": pool["pool_state"], "worker_log": pool["worker_log"],
               "mlflow": pool["mlflow"]}


def _pipeline_runs(client: MlflowClient) -> list:
    exp = client.get_experiment_by_name("tests")
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], "tags.`traingate.kind` = 'pipeline'", order_by=["start_time ASC"])


def _assert_code_untouched(stack) -> None:
    after = _snapshot(stack["code"])
    assert after == stack["before"], (f"written into the code directory: "
                                      f"{sorted(set(after.items()) ^ set(stack['before'].items()))[:10]}")
    status = [line for line in _git(stack["code"], "status", "--porcelain", "--ignored").splitlines()
              if "__pycache__" not in line]
    assert status == []


@pytest.mark.timeout(1200)
def test_a_deployment_run_takes_its_pools_locations_and_writes_nothing_into_its_code_directory(stack):
    from prefect import get_client
    from prefect.deployments import run_deployment

    with prefect_api_at(stack["url"]):
        with get_client(sync_client=True) as c:
            pool_env = c.read_work_pool("cpu-local").base_job_template["variables"]["properties"]["env"]["default"]
        assert pool_env == {"TRAINGATE_STATE_DIR": str(stack["pool_state"])}
        run = run_deployment("ladder/ladder-cpu", parameters={"spec": yaml.safe_load(TINY_DIGITS), "until": "smoke"},
                             timeout=RUN_TIMEOUT_S, poll_interval=2)
    assert run.state.is_completed(), f"{run.state.message}; worker log: {tail(stack['worker_log'])}"
    (first,) = _pipeline_runs(stack["mlflow"])  # in the pool's state dir
    assert first.data.tags["traingate.reached_stage"] == "smoke"
    # The code directory is the version, and the run left it clean (a state dir inside it would make it dirty).
    assert (first.data.tags["traingate.code_version"], first.data.tags["traingate.code_dirty"],
            first.data.tags["traingate.code_source"]) == (stack["a"], "false", "git")
    assert (stack["pool_state"] / "runs" / first.info.run_id / "smoke").is_dir()
    _assert_code_untouched(stack)


@pytest.mark.timeout(600)
def test_a_deployment_run_without_a_state_dir_refuses_to_start_in_one_line(stack):
    from prefect.deployments import run_deployment

    with prefect_api_at(stack["url"]):
        # A deployment (or a trigger) that blanks the pool's state dir: the embedded default would be the code dir.
        run = run_deployment("ladder/ladder-cpu", parameters={"spec": yaml.safe_load(TINY_DIGITS), "until": "smoke"},
                             job_variables={"env": {"TRAINGATE_STATE_DIR": ""}}, timeout=RUN_TIMEOUT_S, poll_interval=2)
    assert run.state.is_failed()
    assert run.state.message == (
        f"TRAINGATE_STATE_DIR is not set for this flow run: its state would go to {stack['code']}/.traingate, inside "
        "the code directory; set the pool's locations with `traingate pools bootstrap` (TRAINGATE_STATE_DIR in its "
        "environment) or in the worker's environment")
    _assert_code_untouched(stack)


@pytest.mark.timeout(1500)
def test_ci_runs_the_commit_it_is_given_and_prints_the_gates_reason(stack):
    def ci(commit: str, *more: str) -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, "-m", "flows.cli", "ci", "--commit", commit, "--spec", "ci-tiny.yaml",
                               "--until", "smoke", *more], env=stack["env"], cwd=stack["repo"].parent,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 60)

    known = {r.info.run_id for r in _pipeline_runs(stack["mlflow"])}
    passed = ci(stack["a"][:12])
    assert passed.returncode == 0, passed.stdout + passed.stderr + tail(stack["worker_log"])
    assert passed.stdout.splitlines()[0] == f"ci {stack['a'][:12]}: PASSED: all 2 stages passed"
    failing_gate = 'gates.smoke.rules=[{metric: resumed_from_step, op: ">=", value: 1000}]'
    stopped = ci(stack["b"], "--set", failing_gate)
    assert stopped.returncode == 1, stopped.stdout + stopped.stderr + tail(stack["worker_log"])
    # The gate's reason, as B's code words it: B's flow ran, not the worker's copy of A.
    first = stopped.stdout.splitlines()[0]
    assert first.startswith(f"ci {stack['b']}: FAILED: {MARKER}gate after smoke: FAILED: resumed_from_step = "), first
    assert first.endswith("required >= 1000"), first

    new = [r for r in _pipeline_runs(stack["mlflow"]) if r.info.run_id not in known]
    assert [(r.data.tags["traingate.code_version"], r.data.tags["traingate.code_dirty"]) for r in new] == \
        [(stack["a"], "false"), (stack["b"], "false")]
    assert [r.data.tags["traingate.reached_stage"] for r in new] == ["smoke", "smoke"]
    # The commits were checked out under the pool's state dir; the worker's code directory is as it was.
    assert {p.name for p in (stack["pool_state"] / "ci").iterdir()} == {"repo.git", stack["a"], stack["b"]}
    _assert_code_untouched(stack)


def test_ci_without_a_server_or_with_a_bad_commit_says_so_in_one_line(monkeypatch, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.cli import main

    # In this process, with no Prefect server set: the session's (if this worker started it) set aside.
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert PREFECT_API_URL.value() is None
        capsys.readouterr()
        assert main(["ci", "--commit", "main"]) == 2
        assert capsys.readouterr().err == "traingate ci: --commit 'main' is not a git sha; pass e.g. " \
                                          "$(git rev-parse HEAD)\n"
        assert main(["ci", "--commit", "a" * 40]) == 2
        err = capsys.readouterr().err
    assert err.startswith("traingate ci: PREFECT_API_URL is not set"), err
