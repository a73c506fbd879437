"""Samplers and schedulers, wired from the spec, on a real Optuna SQLite study with a fast synthetic objective.

The objective reports a learning curve through the same Reporter the trial task uses,
so pruning here goes through the exact code path a training process's progress does.
"""
from __future__ import annotations

import math

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy import event

from traingate.sweepspec import SweepSpec
from traingate.sweep.driver import drive
from traingate.sweep.report import Reporter, TrialOutcome
from traingate.sweep.results import ranked
from traingate.sweep.study import _storage

MAX_STEPS = 100


def _sweep(**kw) -> SweepSpec:
    base = {"space": {"optim.lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
                      "recipe.params.hidden": {"type": "categorical", "choices": [8, 16, 32]}},
            "n_trials": 12, "seed": 1, "heartbeat_s": 1, "grace_s": 2}
    base.update(kw)
    return SweepSpec.model_validate(base)


def _study(tmp_path, sw: SweepSpec, on_stale=None, heartbeat: bool = False) -> optuna.Study:
    """A SQLite study; heartbeats only where a test needs them (each one is a write that contends)."""
    from traingate.sweep.algorithms import make_pruner, make_sampler

    url = f"sqlite:///{tmp_path}/optuna.db"
    storage = _storage(url, sw.heartbeat_s, sw.grace_s, on_stale) if heartbeat else optuna.storages.RDBStorage(url)
    # Real SQLite, minus the fsync per commit: these tests are about the algorithms, not durability,
    # and a loaded CI disk makes each commit cost ~20 ms.
    event.listen(storage.engine, "connect", lambda conn, _: conn.execute("PRAGMA synchronous=OFF"))
    storage.engine.dispose()  # connections opened while creating the schema predate the pragma
    return optuna.create_study(storage=storage,
                               directions=sw.directions, sampler=make_sampler(sw), pruner=make_pruner(sw, MAX_STEPS))


def _curve(params: dict, step: int) -> float:
    """Accuracy after `step` steps: best near lr=0.01, wider nets a little better."""
    quality = max(0.05, 1.0 - 0.15 * (math.log10(params["optim.lr"]) + 2) ** 2) * (0.9 + params["recipe.params.hidden"] / 320)
    return quality * (1 - math.exp(-step / 25))


def _objective(sw: SweepSpec):
    def run(trial: optuna.Trial, params: dict) -> TrialOutcome:
        rep = Reporter(trial, sw)
        for step in range(20, MAX_STEPS + 1, 20):
            if rep.feed({"step": step, "val_accuracy": _curve(params, step)}):
                return TrialOutcome("pruned", steps=step, pruned_at_step=rep.pruned_at)
        acc = _curve(params, MAX_STEPS)
        values = [acc] if len(sw.objectives) == 1 else [acc, params["recipe.params.hidden"] / 32]
        return TrialOutcome("completed", values=values, steps=MAX_STEPS, cost_usd=0.01)
    return run


@pytest.mark.parametrize("sampler", ["grid", "random", "tpe", "cmaes", "nsga2"])
def test_every_sampler_runs_a_sweep_to_its_trial_budget(tmp_path, sampler):
    space = None
    if sampler == "grid":
        space = {"optim.lr": {"type": "float", "low": 0.001, "high": 0.011, "step": 0.005},
                 "recipe.params.hidden": {"type": "categorical", "choices": [8, 32]}}
    sw = _sweep(sampler=sampler, n_trials=6, **({"space": space} if space else {}))
    study = _study(tmp_path, sw)
    result = drive(study, sw, _objective(sw), poll_s=0.05)
    assert len(result.finished) == 6 and all(t.state == TrialState.COMPLETE for t in result.finished)
    if sampler == "grid":  # 3 x 2 points, each exactly once
        assert len({tuple(sorted(t.params.items())) for t in result.finished}) == 6
    assert ranked(study, sw)[0].values[0] == max(t.values[0] for t in result.finished)


def test_grid_sweep_stops_when_the_grid_is_exhausted(tmp_path):
    sw = _sweep(sampler="grid", n_trials=50, space={"recipe.params.hidden": {"type": "categorical", "choices": [8, 32]}})
    study = _study(tmp_path, sw)
    sw2 = sw.model_copy(update={"space": sw.space})
    result = drive(study, sw2, lambda t, p: TrialOutcome("completed", values=[p["recipe.params.hidden"]]), poll_s=0.05)
    assert len(result.finished) == 2 and result.stop_reason == "search space exhausted"


@pytest.mark.parametrize("sampler", ["nsga2", "tpe", "random"])
def test_two_objectives_give_a_pareto_front_ranked_first(tmp_path, sampler):
    sw = _sweep(sampler=sampler, n_trials=8, objectives=[{"metric": "val_accuracy", "direction": "maximize"},
                                                        {"metric": "cost_usd", "direction": "minimize"}])
    study = _study(tmp_path, sw)
    drive(study, sw, _objective(sw), poll_s=0.05)
    front = {t.number for t in study.best_trials}
    order = [t.number for t in ranked(study, sw)]
    assert front and set(order[:len(front)]) == front


@pytest.mark.parametrize("scheduler", ["fifo", "median", "asha", "hyperband", "pbt"])
def test_every_scheduler_runs_and_only_the_pruning_ones_stop_trials_early(tmp_path, scheduler):
    n = 12 if scheduler == "hyperband" else 9  # hyperband splits trials over brackets; each needs company
    sw = _sweep(sampler="random", n_trials=n, scheduler={"name": scheduler, "report_every": 20, "min_resource": 20,
                                                         "reduction_factor": 2, "startup_trials": 2})
    study = _study(tmp_path, sw)
    result = drive(study, sw, _objective(sw), poll_s=0.05)
    pruned = [t for t in result.finished if t.state == TrialState.PRUNED]
    assert len(result.finished) == n
    if scheduler in ("fifo", "pbt"):  # PBT exploits between generations; it never prunes
        assert not pruned and result.steps == n * MAX_STEPS
    else:
        assert pruned, [t.intermediate_values for t in result.finished]
        assert all(t.user_attrs["outcome"]["steps"] < MAX_STEPS for t in pruned)
        assert result.steps < n * MAX_STEPS


def test_conditional_parameter_is_sampled_only_when_its_condition_holds(tmp_path):
    sw = _sweep(sampler="tpe", n_trials=10, space={
        "optim.schedule": {"type": "categorical", "choices": ["constant", "cosine"]},
        "optim.warmup_steps": {"type": "int", "low": 0, "high": 20, "when": {"optim.schedule": "cosine"}}})
    study = _study(tmp_path, sw)
    drive(study, sw, lambda t, p: TrialOutcome("completed", values=[p.get("optim.warmup_steps", 0)]), poll_s=0.05)
    for t in study.trials:
        assert ("optim.warmup_steps" in t.params) == (t.params["optim.schedule"] == "cosine")
    assert {t.params["optim.schedule"] for t in study.trials} == {"constant", "cosine"}


def test_cost_budget_stops_starting_new_trials(tmp_path):
    sw = _sweep(sampler="random", n_trials=20, budget={"max_cost_usd": 0.03})
    study = _study(tmp_path, sw)
    result = drive(study, sw, _objective(sw), poll_s=0.05)
    assert len(result.finished) == 3 and "cost budget" in result.stop_reason


def test_concurrent_trials_in_one_driver_never_exceed_max_concurrent(tmp_path):
    import threading
    import time

    sw = _sweep(sampler="random", n_trials=8, max_concurrent=3)
    lock, live, peak = threading.Lock(), [0], [0]

    def run(trial, params):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.2)
        with lock:
            live[0] -= 1
        return TrialOutcome("completed", values=[params["optim.lr"]])
    drive(_study(tmp_path, sw), sw, run, poll_s=0.05)
    assert 1 <= peak[0] <= 3


def test_a_dead_drivers_running_trial_is_requeued_with_its_params_and_key(tmp_path):
    import time

    stale_seen = []
    sw = _sweep(sampler="random", n_trials=2)
    study = _study(tmp_path, sw, on_stale=lambda t: stale_seen.append(t.number), heartbeat=True)
    orphan = study.ask()  # a trial some driver started and then died with
    orphan.suggest_float("optim.lr", 1e-4, 1.0, log=True)
    orphan.suggest_categorical("recipe.params.hidden", [8, 16, 32])
    orphan.set_user_attr("trial_key", "trial-0000")
    study._storage.record_heartbeat(orphan._trial_id)
    time.sleep(sw.grace_s + 1)
    keys = []

    def run(trial, params):
        keys.append(trial.user_attrs["trial_key"])
        return TrialOutcome("completed", values=[1.0])
    result = drive(study, sw, run, poll_s=0.05)
    trials = study.trials
    assert stale_seen == [0] and trials[0].state == TrialState.FAIL
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == 0]
    assert len(retry) == 1 and retry[0].params == trials[0].params and retry[0].state == TrialState.COMPLETE
    assert "trial-0000" in keys and len(result.finished) == 2


def test_a_trial_a_dead_driver_asked_for_but_never_started_is_requeued_instead_of_waited_for(tmp_path):
    import time

    sw = _sweep(sampler="random", n_trials=2)
    study = _study(tmp_path, sw, heartbeat=True)
    study.ask()  # the driver died inside ask(): no key, no params, no heartbeat ever
    time.sleep(sw.grace_s + 1)
    keys = []

    def run(trial, params):
        keys.append(trial.user_attrs["trial_key"])
        return TrialOutcome("completed", values=[1.0])
    result = drive(study, sw, run, poll_s=0.05)  # waited forever for trial 0 before the fix
    trials = study.trials
    assert trials[0].state == TrialState.FAIL
    assert [t.system_attrs.get("failed_trial") for t in trials].count(0) == 1
    assert len(result.finished) == 2 and len(keys) == 2


def test_a_trial_whose_heartbeat_thread_stalls_past_the_grace_period_is_not_failed_by_its_own_driver(
        tmp_path, monkeypatch):
    import contextlib
    import time

    from traingate.sweep import driver

    # A heartbeat thread that beats once and then never gets to again: what a starved thread or a long
    # SQLite write lock looks like.
    def stalled(study, trial, every_s):
        study._storage.record_heartbeat(trial._trial_id)
        return contextlib.nullcontext()
    monkeypatch.setattr(driver, "heartbeat", stalled)
    # A grace of 3 s: with 2 s, a box running three test workers on two cores once saw both trials judged stale
    # (heartbeats are kept to the second, and the driver's own beat and its check are transactions apart).
    sw = _sweep(sampler="random", n_trials=2, max_concurrent=2, grace_s=3)
    stale_seen = []
    study = _study(tmp_path, sw, on_stale=lambda t: stale_seen.append(t.number), heartbeat=True)

    def run(trial, params):
        time.sleep(sw.grace_s + 2)
        return TrialOutcome("completed", values=[1.0])
    result = drive(study, sw, run, poll_s=0.05)
    assert stale_seen == []
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2 and len(result.finished) == 2


def test_a_trial_another_driver_failed_while_it_ran_here_leaves_the_sweep_running(tmp_path, caplog):
    sw = _sweep(sampler="random", n_trials=1)
    study = _study(tmp_path, sw, heartbeat=True)

    def run(trial, params):  # another driver judged it stale mid-run and failed it
        study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
        return TrialOutcome("completed", values=[1.0])
    drive(study, sw, run, poll_s=0.05)  # raised UpdateFinishedTrialError out of the sweep before
    assert study.trials[0].state == TrialState.FAIL and "outcome" not in study.trials[0].user_attrs
    assert "judged stale and re-queued by another driver" in caplog.text
