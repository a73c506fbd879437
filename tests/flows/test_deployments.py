"""The ladder deployments as the UI uses them: a real `prefect server start`, the deployments of
deployments/prefect.yaml, a real process worker, and flow runs triggered through the API with a
RunSpec given as a plain mapping (no spec file for the worker)."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tgtest import PYTHON, ROOT, TINY_DIGITS, prefect_api_at, prefect_server, stop_tree, tail
from traingate.settings import Settings
from traingate.spec import RunSpec

pytestmark = pytest.mark.slow

BIN = Path(PYTHON).parent
# Measured on the shared 2-core machine: the whole test 7.4 min at a load average of 4-8 from other
# test runs, 14 min at ~10, when one ladder run to the canary took up to 6 min.
RUN_TIMEOUT_S = 600


@pytest.fixture
def server(tmp_path):
    """A real Prefect server on a free loopback port, its home and SQLite database under tmp_path."""
    with prefect_server(tmp_path) as s:
        yield s


@pytest.fixture
def deployed(server, tmp_path):
    """The cpu-local pool and its slot limit as infra/pools/create_pools.sh makes them, the ladder
    deployments from deployments/prefect.yaml, and one worker on the pool."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.cli.pools import job_template
    from traingate.capacity.pools import parse_config

    state = tmp_path / "worker-state"
    # `python` of the pool's command (flows/warm_engine.py) is this interpreter, as in the training image.
    env = {**server["env"], "TRAINGATE_CODE_DIR": str(ROOT), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    pool = parse_config({"pools": {"cpu-local": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 0,
                                                 "worker": "process"}}}).pools["cpu-local"]
    # The deploying shell has no state dir of its own: where state lives is the worker's to say.
    env.pop("TRAINGATE_STATE_DIR", None)
    with prefect_api_at(server["url"]), get_client(sync_client=True) as c:
        c.create_work_pool(WorkPoolCreate(name="cpu-local", type="process",
                                          base_job_template=job_template(pool, None, "cpu-local")))
        c.upsert_global_concurrency_limit_by_name("cpu-local", 2)
    p = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml",
                        "--name", "ladder-cpu", "--name", "ladder-resume"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # Its flow runs inherit this environment; a 2 s poll instead of 10 s keeps the test short.
    worker_env = {**env, "TRAINGATE_STATE_DIR": str(state), "PREFECT_WORKER_QUERY_SECONDS": "2"}
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        # Wrapped as infra/docker-compose.yml wraps it: its flow runs are forked from a pre-imported zygote.
        worker = subprocess.Popen([PYTHON, "-m", "flows.warm_engine", "--worker",
                                   str(BIN / "prefect"), "worker", "start", "--pool", "cpu-local", "--type", "process"],
                                  env=worker_env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        with prefect_api_at(server["url"]):
            yield {"state": state, "worker_log": log}
    finally:
        # A worker ignores its first SIGTERM; SIGINT stops it. Before the server, so it never
        # polls a dead API.
        stop_tree(worker, signal.SIGINT, 20)


def _trigger(deployment: str, parameters: dict, worker_log: Path):
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    run = run_deployment(deployment, parameters=parameters, timeout=RUN_TIMEOUT_S, poll_interval=2)
    if not run.state.is_completed():
        with get_client(sync_client=True) as c:
            logs = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        text = "\n".join(rec.message for rec in logs)[-4000:]
        pytest.fail(f"{deployment} {parameters.get('until')}: flow run {run.state.type.value} "
                    f"({run.state.message}); flow-run log: {text}; worker log: {tail(worker_log)}")
    return run


def _pipeline_runs(client: MlflowClient) -> dict[str, object]:
    exp = client.get_experiment_by_name("tests")
    assert exp is not None, "no MLflow experiment 'tests' in the worker's state dir"
    runs = client.search_runs([exp.experiment_id], "tags.`traingate.kind` = 'pipeline'")
    return {r.info.run_id: r for r in runs}


def _stages(client: MlflowClient, parent) -> set[str]:
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return {r.data.tags["traingate.stage"] for r in runs}


@pytest.mark.timeout(1500)
def test_ladder_deployment_runs_a_spec_mapping_and_a_resume_through_the_api(deployed):
    from prefect import get_client

    with get_client(sync_client=True) as c:
        ladder = c.read_deployment_by_name("ladder/ladder-cpu")
        names = {d.name for d in c.read_deployments()}
    assert names == {"ladder-cpu", "ladder-resume"}
    # The UI form: spec is a RunSpec with its sections, not a string for a path.
    schema = ladder.parameter_openapi_schema
    assert schema["properties"]["spec"]["anyOf"][0] == {"$ref": "#/definitions/RunSpec"}
    runspec = schema["definitions"]["RunSpec"]
    assert set(runspec["properties"]) == set(RunSpec.model_fields)
    assert set(runspec["required"]) == {"identity", "recipe"}
    assert schema["properties"]["resume_from"]["anyOf"][0] == {"$ref": "#/definitions/ResumeFrom"}

    # A run of a RunSpec mapping stopped after smoke, continued at canary by the resume deployment.
    spec = yaml.safe_load(TINY_DIGITS)
    first = _trigger("ladder/ladder-cpu", {"spec": spec, "until": "smoke"}, deployed["worker_log"])
    client = MlflowClient(Settings.from_env({"TRAINGATE_STATE_DIR": str(deployed["state"])}).tracking_uri)
    (stopped,) = _pipeline_runs(client).values()
    assert stopped.info.status == "FINISHED"
    assert stopped.data.tags["traingate.reached_stage"] == "smoke"
    assert stopped.data.params["optim.lr"] == "0.05"  # the mapping's value, not the deployment's demo spec
    assert _stages(client, stopped) == {"unit", "smoke"}
    run_id = stopped.info.run_id
    second = _trigger("ladder/ladder-resume", {"resume_from": {"run_id": run_id, "stage": "canary"}, "until": "canary"},
                      deployed["worker_log"])
    # Both flow runs' processes were forked from the worker's zygote (flows/warm_engine.py), not started cold.
    log = deployed["worker_log"].read_text()
    assert all(f"for flow run {r.id}" in log for r in (first, second)), tail(deployed["worker_log"])
    # So were the first run's unit tests (traingate.launch.pytest_child), with the contract tests' imports loaded.
    assert f"for a unit stage's tests {first.id}" in log, tail(deployed["worker_log"])
    runs = _pipeline_runs(client)
    assert list(runs) == [run_id], "a resume continues the run; it opens no new one"
    resumed = runs[run_id]
    assert resumed.info.status == "FINISHED" and resumed.data.tags["traingate.reached_stage"] == "canary"
    assert _stages(client, resumed) == {"unit", "smoke", "canary"}
