"""The sweep flow end to end: real Prefect (harness), real Optuna SQLite storage, real training processes."""
from __future__ import annotations

import json

import optuna
import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from tests.sweep.conftest import ONE_PROC, load, max_overlap

pytestmark = pytest.mark.slow


def _settings():
    from traingate.settings import Settings

    return Settings.from_env().ensure()


def test_pruned_trial_stops_its_process_early_and_everything_lands_in_mlflow(prefect_harness, state_dir, sweep_spec):
    from flows.sweep import sweep
    from traingate.spec import load_spec
    from traingate.sweep.study import open_study

    path = sweep_spec("""
        scheduler: {name: asha, report_every: 20, min_resource: 20, reduction_factor: 2}
        n_trials: 2
        max_concurrent: 1
    """)
    overrides = ONE_PROC + ["stages.canary.max_steps=400", "checkpoint.every_steps=1000"]
    s = _settings()
    # A good configuration first, then a hopeless one (lr near zero): ASHA must cut the second at its first rung.
    study = open_study(load_spec(path, overrides), s.optuna_storage)
    study.enqueue_trial({"optim.lr": 0.05, "recipe.params.hidden": 16})
    study.enqueue_trial({"optim.lr": 0.002, "recipe.params.hidden": 8})
    study.set_user_attr("note", "seeded by the test")

    state = sweep(str(path), overrides, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()

    study = load(path, overrides, s.optuna_storage)
    good, bad = study.trials
    assert good.state == TrialState.COMPLETE and good.user_attrs["steps"] == 400
    assert bad.state == TrialState.PRUNED, (bad.intermediate_values, good.intermediate_values)
    assert bad.user_attrs["pruned_at_step"] == 20
    assert bad.user_attrs["steps"] < 400  # stopped while running, not after the fact
    assert not psutil.pid_exists(bad.user_attrs["pid"])
    assert set(bad.intermediate_values) == {20}

    # The best configuration is a ready-to-run spec.
    best = load_spec(summary["best_spec"])
    assert best.optim.lr == pytest.approx(0.05) and best.recipe.params["hidden"] == 16 and best.sweep is None
    assert "sweep" not in yaml.safe_load(open(summary["best_spec"]))

    # MLflow: the sweep is a parent run, each trial a child with params, intermediate metrics and state.
    c = MlflowClient(s.tracking_uri)
    parent = c.get_run(summary["parent_run_id"])
    assert parent.data.tags["traingate.kind"] == "sweep" and parent.info.status == "FINISHED"
    children = c.search_runs([parent.info.experiment_id],
                             filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_state = {r.data.tags["traingate.trial_state"]: r for r in children}
    assert set(by_state) == {"COMPLETE", "PRUNED"}
    assert by_state["PRUNED"].info.status == "KILLED"
    assert by_state["COMPLETE"].data.params["optim.lr"] == "0.05"
    history = c.get_metric_history(by_state["COMPLETE"].info.run_id, "val_accuracy")
    assert sorted({m.step for m in history}) == list(range(20, 401, 20))  # intermediate, from the trainer
    arts = {a.path for a in c.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/optimization_history.png", "sweep/intermediate_values.png", "sweep/best_spec.yaml"} <= arts


def test_trials_never_run_more_at_once_than_the_pool_limit_allows(prefect_harness, state_dir, sweep_spec):
    from prefect.client.orchestration import get_client

    from flows.sweep import sweep

    with get_client(sync_client=True) as c:  # a work pool with one slot, shared with everything else
        c.upsert_global_concurrency_limit_by_name("tg-test-pool-1slot", 1)
    path = sweep_spec("""
        scheduler: {name: fifo, report_every: 50}
        n_trials: 3
        max_concurrent: 3
        pool_limit: tg-test-pool-1slot
    """)
    overrides = ONE_PROC + ["stages.canary.max_steps=150", "checkpoint.every_steps=1000"]
    state = sweep(str(path), overrides, return_state=True)
    assert state.is_completed(), state.message
    trials = load(path, overrides, _settings().optuna_storage).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    spans = [(t.user_attrs["start_ts"], t.user_attrs["end_ts"]) for t in trials]
    assert max_overlap(spans) == 1, spans
