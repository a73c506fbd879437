"""Scheduled retraining end to end: a real `prefect server start`, the pools bootstrap, the
`digits-nightly-retrain` deployment of deployments/prefect.yaml, a process worker, MLflow on SQLite
in the pool's state dir, real torchrun ladders.

The platform team points the deployment at a tiny char-gpt spec whose data.uri names ``{latest}`` and
sets its schedule a few seconds ahead: the server's scheduler creates the run by itself and the worker
runs it; that retrain (no champion yet) takes @champion. Then retrains run here against the same server
and store: unchanged data is skipped; a worse model on a new snapshot is not promoted; a better one is.
"""
from __future__ import annotations

import datetime
import time

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tgtest import ROOT, pool_worker, prefect_api_at, prefect_server, tail
from traingate.spec import load_spec_text

from retrain_data import publish, tiny_chargpt

pytestmark = pytest.mark.slow

MODEL = "retrain-tests-char-gpt"
DEPLOYMENT = "retrain/digits-nightly-retrain"
RUN_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retrain")
    with prefect_server(tmp) as server, pool_worker(tmp, server, ROOT, ["digits-nightly-retrain"],
                                                    worker_cwd=tmp) as pool:
        yield {"url": server["url"], "pool_state": pool["pool_state"], "corpus": tmp / "corpus",
               "worker_log": pool["worker_log"], "mlflow": pool["mlflow"]}


@pytest.fixture(scope="module")
def scheduled(stack):
    """The deployment edited as a platform team does (its spec, its schedule 8 s from now); the run the
    server's scheduler creates, once the worker has finished it."""
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.schedules import IntervalSchedule

    publish(stack["corpus"], "2026-11-20", seed=1)
    spec = yaml.safe_load(tiny_chargpt(f"{stack['corpus'].as_uri()}/{{latest}}/input.txt"))
    with prefect_api_at(stack["url"]), get_client(sync_client=True) as c:
        d = c.read_deployment_by_name(DEPLOYMENT)
        assert d.entrypoint == "flows/retrain.py:retrain"
        c.update_deployment(d.id, DeploymentUpdate(parameters={"spec": spec}))
        for s in c.read_deployment_schedules(d.id):
            c.delete_deployment_schedule(d.id, s.id)
        due = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=8)
        c.create_deployment_schedules(d.id, [(IntervalSchedule(interval=datetime.timedelta(days=1),
                                                               anchor_date=due), True)])
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            runs = [r for r in c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[d.id])))
                    if r.state is not None and r.state.is_final()]
            if runs:
                break
            assert time.monotonic() < deadline, f"no finished scheduled run; worker log: {tail(stack['worker_log'])}"
            time.sleep(2)
    return {"run": runs[0], "due": due}


def _champion(c: MlflowClient) -> str:
    return str(c.get_registered_model(MODEL).aliases["champion"])


def _runs(c: MlflowClient) -> list:
    exp = c.get_experiment_by_name("retrain-tests")
    return c.search_runs([exp.experiment_id]) if exp else []


@pytest.mark.timeout(900)
def test_a_schedule_a_few_seconds_ahead_starts_a_retrain_on_the_worker_that_takes_the_first_champion(stack,
                                                                                                   scheduled):
    run = scheduled["run"]
    assert run.auto_scheduled and run.expected_start_time == scheduled["due"]
    assert run.state.is_completed(), f"{run.state.message}; worker log: {tail(stack['worker_log'])}"
    assert run.state.message.startswith(f"{MODEL} v1 took @champion: no champion yet"), run.state.message
    c = stack["mlflow"]  # the pool's store: the worker's flow run took its locations from the pool
    assert _champion(c) == "1"
    (full,) = c.search_runs([c.get_experiment_by_name("retrain-tests").experiment_id],
                            "tags.`traingate.stage` = 'full'")
    assert full.data.tags["traingate.data_uri"] == f"{stack['corpus'].as_uri()}/2026-11-20/input.txt"
    assert full.data.tags["traingate.retrain.decision"] == "promoted"
    assert "retrain.challenger_val_loss" in full.data.metrics and "retrain.champion_val_loss" not in full.data.metrics


@pytest.mark.timeout(900)
def test_unchanged_data_is_skipped_a_worse_model_is_not_promoted_and_a_better_one_is(stack, scheduled, monkeypatch):
    from prefect.artifacts import Artifact

    from flows.retrain import retrain

    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(stack["pool_state"]))  # the store the scheduled run wrote
    spec_text = tiny_chargpt(f"{stack['corpus'].as_uri()}/{{latest}}/input.txt")
    c = stack["mlflow"]
    assert _champion(c) == "1"
    with prefect_api_at(stack["url"]):
        # The champion's snapshot is still the newest: skipped, Completed, no ladder and no new MLflow run.
        before = len(_runs(c))
        snapshot = c.get_model_version(MODEL, "1").tags["traingate.data_snapshot"]
        skipped = retrain(load_spec_text(spec_text), return_state=True)
        assert skipped.is_completed()
        assert skipped.message.startswith(f"skipped: data unchanged since champion v1 of {MODEL} "
                                          f"(snapshot {snapshot[:12]}, "), skipped.message
        assert len(_runs(c)) == before

        # A new snapshot, but a crippled run (2 full steps): worse on the same held-out data, not promoted.
        publish(stack["corpus"], "2026-11-21", seed=2)
        worse = retrain(load_spec_text(spec_text, ["stages.full.max_steps=2"]), return_state=True)
        assert worse.is_completed(), worse.message
        out = worse.result()["retrain"]
        assert (out["promoted"], out["champion_version"], out["version"]) == (False, "1", "2")
        assert out["champion_val_loss"] < out["challenger_val_loss"]
        assert worse.message.startswith(f"{MODEL} v2 NOT promoted, @champion stays at v1: challenger val_loss "), \
            worse.message
        assert _champion(c) == "1"
        run = c.get_run(worse.result()["stages"]["full"]["mlflow_run_id"])
        assert run.data.metrics["retrain.champion_val_loss"] == pytest.approx(out["champion_val_loss"])
        assert run.data.metrics["retrain.challenger_val_loss"] == pytest.approx(out["challenger_val_loss"])
        assert run.data.metrics["retrain.margin"] == 0.0
        assert (run.data.tags["traingate.retrain.decision"], run.data.tags["traingate.retrain.champion_version"]) == \
            ("not promoted", "1")
        assert run.data.tags["traingate.data_uri"] == f"{stack['corpus'].as_uri()}/2026-11-21/input.txt"
        artifact = Artifact.get(f"retrain-{MODEL}")
        assert artifact is not None and "v2 NOT promoted" in artifact.data and "champion_val_loss" in artifact.data

        # A newer snapshot, trained longer: beats the champion by more than the margin, promoted.
        publish(stack["corpus"], "2026-11-22", seed=3)
        better = retrain(load_spec_text(spec_text, ["stages.full.max_steps=100", "promotion.margin=0.01"]),
                         return_state=True)
        assert better.is_completed(), better.message
        out = better.result()["retrain"]
        assert (out["promoted"], out["champion_version"], out["version"]) == (True, "1", "3"), out
        assert out["champion_val_loss"] - out["challenger_val_loss"] > 0.01
        assert better.message.startswith(f"{MODEL} v3 took @champion: challenger val_loss "), better.message
        assert _champion(c) == "3"
        assert c.get_model_version(MODEL, "3").tags["traingate.champion_decision"].startswith("promoted: ")


@pytest.mark.timeout(600)
def test_a_retrain_whose_ladder_fails_a_gate_ends_failed_and_moves_no_alias(stack, scheduled, monkeypatch):

    from flows.retrain import retrain

    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(stack["pool_state"]))
    c = stack["mlflow"]
    held, versions = _champion(c), len(c.search_model_versions(f"name = '{MODEL}'"))
    publish(stack["corpus"], "2026-11-23", seed=4)
    spec = load_spec_text(tiny_chargpt(f"{stack['corpus'].as_uri()}/{{latest}}/input.txt"),
                          ['gates.unit.rules=[{metric: tests_passed, op: ">=", value: 1000}]'])
    with prefect_api_at(stack["url"]):
        state = retrain(spec, return_state=True)
    assert state.is_failed()
    assert state.message.startswith("gate after unit: FAILED: tests_passed = "), state.message
    assert _champion(c) == held
    assert len(c.search_model_versions(f"name = '{MODEL}'")) == versions
