"""The budget a stage starts with (tasks/train.py `_with_budget`): the tightest of the run's
`budget.max_run_usd` (spend from the run directory) and its team's budget per period (the pools
config on a real Prefect server, spend from a real MLflow store); the supervisor pauses the stage at it."""
from __future__ import annotations

import logging

import pytest

from traingate.job import files
from traingate.job.stagejob import derive
from traingate.settings import Settings
from traingate.spec import load_spec


@pytest.fixture
def pools_config(prefect_harness):
    from prefect import get_client

    from tasks import slots

    def put(value: dict) -> None:
        with get_client(sync_client=True) as c:
            slots.put_variable(c, slots.CONFIG_VAR, value)
    yield put
    with get_client(sync_client=True) as c:
        slots.delete_variable(c, slots.CONFIG_VAR)


def _job(tiny_spec, tmp_path, *overrides: str):
    spec = load_spec(tiny_spec(), ["identity.team=vision", *overrides])
    job = derive(spec, "full", run_id="r1", run_dir=tmp_path / "r1", settings=Settings.from_env(),
                 mlflow_run_id="m1")
    # the run's canary already held 2 slots for 90 s at $10 a slot-hour: $0.50
    canary = tmp_path / "r1" / "canary"
    canary.mkdir(parents=True)
    files.write_json(canary / files.JOB, {"slots": 2, "price_per_slot_hour": 10.0})
    files.write_supervisor_state(canary, files.SupervisorState(attempts=[{"launched_at": 0.0, "ended_at": 90.0}]))
    return job


def _with_budget(job):
    from prefect import get_client

    from tasks.slots import read_config
    from tasks.train import _with_budget
    with get_client(sync_client=True) as c:
        return _with_budget(job, read_config(c), logging.getLogger("test"))


def test_a_stage_starts_with_the_run_budget_less_what_the_run_spent(tiny_spec, tmp_path, state_dir, pools_config):
    job = _with_budget(_job(tiny_spec, tmp_path, "budget.max_run_usd=5"))
    assert (job.budget_scope, job.budget_usd, job.spent_before_usd) == ("run", 5.0, 0.5)


def test_a_team_budget_with_less_left_than_the_run_budget_is_the_one_a_stage_pauses_at(
        tiny_spec, tmp_path, state_dir, pools_config):
    pools_config({"pools": {"cpu-local": {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 0.05,
                                          "worker": "process"}},
                  "team_budgets": {"vision": {"budget_usd": 3.0, "period": "week"}}})
    job = _with_budget(_job(tiny_spec, tmp_path, "budget.max_run_usd=5"))
    # the team has recorded nothing in this (empty) tracking store this week: $3 left against the run's $4.50
    assert (job.budget_scope, job.budget_usd, job.spent_before_usd) == ("team", 3.0, 0.0)


def test_no_budget_means_none_is_set(tiny_spec, tmp_path, state_dir, pools_config):
    job = _with_budget(_job(tiny_spec, tmp_path))
    assert job.budget_usd is None
