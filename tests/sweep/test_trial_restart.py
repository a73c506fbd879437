"""A sweep trial is launched like every other StageJob: a lost worker restarts it from its checkpoint."""
from __future__ import annotations

import optuna
import pytest

from sweep_helpers import load, sweep_spec  # noqa: F401 - sweep_spec is a fixture

pytestmark = pytest.mark.slow

PARAMS = {"optim.lr": 0.05, "recipe.params.hidden": 16}


def _one_trial(path, overrides, state_dir, monkeypatch, inject: str | None) -> optuna.trial.FrozenTrial:
    from flows.cli import main
    from traingate.settings import Settings
    from traingate.spec import load_spec
    from traingate.sweep.study import open_study

    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(state_dir))
    if inject:
        monkeypatch.setenv("TRAINGATE_INJECT", inject)
    else:
        monkeypatch.delenv("TRAINGATE_INJECT", raising=False)
    storage = Settings.from_env().ensure().optuna_storage
    open_study(load_spec(path, overrides), storage).enqueue_trial(PARAMS)
    assert main(["sweep", str(path), *[a for o in overrides for a in ("--set", o)]]) == 0
    (trial,) = load(path, overrides, storage).trials
    return trial


@pytest.mark.parametrize("procs, fault", [(1, "kill@7"), (2, "kill@7:1")], ids=["one-process", "torchrun-2-ranks"])
def test_sweep_trial_whose_worker_is_sigkilled_restarts_from_its_checkpoint_and_ends_like_an_undisturbed_trial(
        prefect_harness, tmp_path, sweep_spec, monkeypatch, procs, fault):
    path = sweep_spec("""
        scheduler: {name: fifo, report_every: 10}
        n_trials: 1
        max_concurrent: 1
    """)
    overrides = [f"resources.procs_per_node={procs}", "recipe.params.channels=4", "stages.canary.max_steps=20",
                 "checkpoint.every_steps=5",
                 # Synchronous saves: the step-5 checkpoint is durable before the kill at step 7 (an async save
                 # still being written would rightly fall back a checkpoint; that is tests/runtime's subject).
                 "checkpoint.async_save=false"]
    calm = _one_trial(path, overrides, tmp_path / "calm", monkeypatch, None)
    hit = _one_trial(path, overrides, tmp_path / "hit", monkeypatch, fault)

    assert calm.state == hit.state == optuna.trial.TrialState.COMPLETE
    calm_out, hit_out = calm.user_attrs["outcome"], hit.user_attrs["outcome"]
    assert calm_out["restarts"] == 0 and hit_out["restarts"] == 1
    assert hit_out["resumed_from_step"] == 5  # the checkpoint before the kill at step 7
    # Exact resume: the restarted trial trains the same weights, so it reports the same objective, bit for bit.
    assert hit.values == calm.values
    assert hit_out["metrics"]["val_loss"] == calm_out["metrics"]["val_loss"]
