"""The sweep flow end to end: real Prefect (harness), real Optuna SQLite storage, real training processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import optuna
import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from sweep_helpers import ONE_PROC, load, max_overlap, sweep_spec  # noqa: F401 - sweep_spec is a fixture
from tgtest import PYTHON

pytestmark = pytest.mark.slow


def _settings():
    from traingate.settings import Settings

    return Settings.from_env().ensure()


def test_pruned_trial_stops_its_process_early_and_the_reproduced_winner_is_promoted_to_full(
        prefect_harness, state_dir, sweep_spec, capsys):
    from flows.cli import main
    from traingate.spec import load_spec
    from traingate.sweep.study import open_study

    path = sweep_spec("""
        scheduler: {name: asha, report_every: 10, min_resource: 10, reduction_factor: 2}
        n_trials: 2
        max_concurrent: 1
        promotion: {top_k: 1, seeds: 1, require_reproducible: true, tolerance: 1.0, until: full}
    """)
    # 300 steps: the hopeless trial is still training when ASHA's verdict on its first rung arrives (a busy box
    # ran a 100-step trial to its end in the time between its report at step 10 and the stop).
    overrides = ONE_PROC + ["stages.canary.max_steps=300", "checkpoint.every_steps=1000"]
    s = _settings()
    # A good configuration first, then a hopeless one (lr near zero): ASHA must cut the second at its first rung.
    study = open_study(load_spec(path, overrides), s.optuna_storage)
    study.enqueue_trial({"optim.lr": 0.05, "recipe.params.hidden": 16})
    study.enqueue_trial({"optim.lr": 0.002, "recipe.params.hidden": 8})

    code = main(["sweep", str(path), *[a for o in overrides for a in ("--set", o)], "--promote"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "reproducibility  ok" in out and "optuna-dashboard sqlite:///" in out

    study = load(path, overrides, s.optuna_storage)
    good, bad = study.trials
    assert good.state == TrialState.COMPLETE and good.user_attrs["outcome"]["steps"] == 300
    assert bad.state == TrialState.PRUNED, (bad.intermediate_values, good.intermediate_values)
    assert bad.user_attrs["outcome"]["pruned_at_step"] == 10
    assert bad.user_attrs["outcome"]["steps"] < 300  # stopped while running, not after the fact
    assert not psutil.pid_exists(bad.user_attrs["outcome"]["pid"])
    assert set(bad.intermediate_values) == {10}

    # The best configuration is a ready-to-run spec.
    best_path = next(line.split()[-1] for line in out.splitlines() if line.strip().startswith("best_spec"))
    best = load_spec(best_path)
    assert best.optim.lr == pytest.approx(0.05) and best.recipe.params["hidden"] == 16 and best.sweep is None
    assert "sweep" not in yaml.safe_load(open(best_path))

    # MLflow: the sweep is a parent run, each trial a child with params, intermediate metrics and state.
    c = MlflowClient(s.tracking_uri)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    parent = next(r for r in runs if r.data.tags.get("traingate.kind") == "sweep")
    assert parent.info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    by_state = {r.data.tags["traingate.trial_state"]: r for r in children
                if "traingate.reproduction_seed" not in r.data.tags}
    assert set(by_state) == {"COMPLETED", "PRUNED"}
    assert by_state["PRUNED"].info.status == "KILLED"
    assert by_state["COMPLETED"].data.params["optim.lr"] == "0.05"
    history = c.get_metric_history(by_state["COMPLETED"].info.run_id, "val_accuracy")
    assert sorted({m.step for m in history}) == list(range(10, 301, 10))  # intermediate, from the trainer
    arts = {a.path for a in c.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/optimization_history.png", "sweep/best_spec.yaml"} <= arts
    assert "sweep/intermediate_values.png" not in arts  # each trial's reported.* metrics: MLflow's own chart

    # The winner was re-run with a new seed, then promoted up the whole ladder.
    rerun = next(r for r in children if "traingate.reproduction_seed" in r.data.tags)
    assert rerun.data.tags["traingate.reproduction_seed"] == "1000" and rerun.info.status == "FINISHED"
    ladder = next(r for r in runs if r.data.tags.get("traingate.kind") == "pipeline")
    assert ladder.data.tags["traingate.reached_stage"] == "full" and ladder.data.tags["traingate.outcome"] == "passed"


def test_trials_never_run_more_at_once_than_the_pool_limit_allows(prefect_harness, state_dir, sweep_spec):
    from prefect.client.orchestration import get_client

    from flows.sweep import sweep_file

    with get_client(sync_client=True) as c:  # a work pool with one slot, shared with everything else
        c.upsert_global_concurrency_limit_by_name("tg-test-pool-1slot", 1)
    path = sweep_spec("""
        scheduler: {name: fifo, report_every: 50}
        n_trials: 2
        max_concurrent: 2
        pool_limit: tg-test-pool-1slot
    """)
    overrides = ONE_PROC + ["stages.canary.max_steps=40", "checkpoint.every_steps=1000"]
    state = sweep_file(str(path), overrides, return_state=True)
    assert state.is_completed(), state.message
    trials = load(path, overrides, _settings().optuna_storage).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    spans = [(t.user_attrs["outcome"]["start_ts"], t.user_attrs["outcome"]["end_ts"]) for t in trials]
    assert max_overlap(spans) == 1, spans


def _kill_node(driver: subprocess.Popen, trial_dirs: list[Path]) -> None:
    """What losing the sweep's machine looks like: the driver and every trainer it started die at once."""
    os.killpg(driver.pid, signal.SIGKILL)
    for d in trial_dirs:
        for hb in d.glob("heartbeat.rank*.json"):
            try:
                os.killpg(os.getpgid(json.loads(hb.read_text())["pid"]), signal.SIGKILL)
            except (ProcessLookupError, ValueError, KeyError):
                pass
    driver.wait(timeout=30)


def test_killed_sweep_resumes_keeping_finished_trials_and_requeueing_running_ones(
        prefect_harness, state_dir, sweep_spec, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from flows.sweep import sweep_file
    from traingate.spec import load_spec
    from traingate.sweep.study import study_name

    path = sweep_spec("""
        scheduler: {name: fifo, report_every: 20}
        n_trials: 3
        max_concurrent: 2
    """)
    overrides = ONE_PROC + ["stages.canary.max_steps=240", "checkpoint.every_steps=20"]
    s = _settings()
    name = study_name(load_spec(path, overrides))
    # The killed driver's trials are paced from step 45 (rank 0 sleeps 0.1 s a step), so the kill
    # polled below finds one between 45 and 200 however fast the box runs tiny steps; the resumed
    # sweep (in this process, without the variable) runs at full speed.
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "TRAINGATE_STATE_DIR": str(state_dir),
           "TRAINGATE_INJECT": "slow@45:0"}
    cmd = [PYTHON, "-m", "flows.cli", "sweep", str(path), *[a for o in overrides for a in ("--set", o)]]
    driver = subprocess.Popen(cmd, env=env, cwd=tmp_path, start_new_session=True,
                              stdout=open(tmp_path / "driver.log", "w"), stderr=subprocess.STDOUT)
    sweep_dir = state_dir / "sweeps" / name
    deadline = time.monotonic() + 400
    victim = None
    while victim is None:
        assert time.monotonic() < deadline, (tmp_path / "driver.log").read_text()[-3000:]
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        time.sleep(0.3)
        try:
            trials = optuna.load_study(study_name=name, storage=s.optuna_storage).trials
        except KeyError:
            continue  # the study does not exist yet
        if not any(t.state == TrialState.COMPLETE for t in trials):
            continue
        for t in trials:
            hb = sweep_dir / t.user_attrs.get("trial_key", "-") / "heartbeat.rank0.json"
            if t.state == TrialState.RUNNING and hb.exists():
                step = json.loads(hb.read_text())["step"]
                if 45 <= step < 200:  # past two checkpoints, far from done
                    victim = t.number
    _kill_node(driver, [p for p in sweep_dir.iterdir() if p.is_dir()])
    before = {t.number: t for t in optuna.load_study(study_name=name, storage=s.optuna_storage).trials}
    done_before = {n: t for n, t in before.items() if t.state == TrialState.COMPLETE}

    state = sweep_file(str(path), overrides, return_state=True)  # re-running the same spec resumes it
    assert state.is_completed(), state.message

    after = optuna.load_study(study_name=name, storage=s.optuna_storage).trials
    for n, t in done_before.items():  # finished trials are kept exactly as they were
        assert after[n].state == TrialState.COMPLETE and after[n].values == t.values
        assert after[n].datetime_complete == t.datetime_complete
    assert after[victim].state == TrialState.FAIL
    retry = [t for t in after if t.system_attrs.get("failed_trial") == victim]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE
    assert retry[0].params == after[victim].params
    assert retry[0].user_attrs["trial_key"] == after[victim].user_attrs["trial_key"]
    assert 20 <= retry[0].user_attrs["outcome"]["resumed_from_step"] < 240  # from its checkpoint, not from scratch
    keys = [t.user_attrs["trial_key"] for t in after if t.state == TrialState.COMPLETE]
    assert len(keys) == len(set(keys)) == 3  # nothing lost, nothing run twice
    spans = [(t.user_attrs["outcome"]["start_ts"], t.user_attrs["outcome"]["end_ts"]) for t in after if t.state == TrialState.COMPLETE]
    assert max_overlap(spans) <= 2

