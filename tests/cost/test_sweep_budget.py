"""A sweep stops at its budget: real Prefect (harness), Optuna SQLite, MLflow SQLite and training processes."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from optuna.trial import TrialState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sweep"))
from sweep_helpers import ONE_PROC, SWEEP_BASE, load  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_sweep_starts_no_trial_once_its_budget_is_spent_and_ends_saying_so(prefect_harness, state_dir, tiny_spec):
    from flows.sweep import sweep_file
    from traingate.cost.source import sweep_spend_usd
    from traingate.settings import Settings
    from traingate.tracking.runs import client

    # $1e-9: the first trial starts (nothing spent yet) and spends more than that; the next must not start.
    path = tiny_spec(SWEEP_BASE + textwrap.indent("n_trials: 3\nbudget: {max_cost_usd: 1.0e-9}\n", "  "))
    overrides = ONE_PROC + ["stages.canary.max_steps=10", "checkpoint.every_steps=1000"]
    state = sweep_file(str(path), overrides, return_state=True)
    settings = Settings.from_env()
    trials = load(path, overrides, settings.optuna_storage).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE]
    spent = trials[0].user_attrs["outcome"]["cost_usd"]
    assert spent > 1e-9
    assert state.is_completed(), state.message
    assert state.message.endswith(f"; budget spent: the trials cost ${spent:.6g} of sweep.budget.max_cost_usd "
                                  "$1e-09, no further trial was started"), state.message
    summary = state.result()
    assert summary["budget_spent"] is True and summary["trials_finished"] == 1
    # The ledger's view of the sweep's spend (what budget_left charges a sweep) is the same number.
    assert sweep_spend_usd(client(settings.tracking_uri), summary["parent_run_id"]) == pytest.approx(spent)
