"""Budgets per run, sweep and team: what is left, computed by the ledger from attempts recorded in a real
MLflow SQLite store, and the gate's one-line refusal per scope."""
from __future__ import annotations

import datetime as dt

import pytest
import yaml
from mlflow.tracking import MlflowClient

from traingate.capacity.pools import CapacityError, Period, TeamBudget, parse_config
from traingate.cost.budget import Scope, budget_left, period_start, spent_between, tightest
from traingate.cost.ledger import Attempt, Outcome
from traingate.cost.source import budgets_for, sweep_spend_usd
from traingate.ladder.gates import decide
from traingate.job.vocab import Status
from traingate.spec import GateSpec, load_spec_text
from traingate.job.result import GateDecision, StageResult
from traingate.tracking import runs

IDENTITY = {"code": {"sha": "0" * 40, "dirty": "false"}, "data_snapshot": "d" * 64,
            "data_uri": "sklearn://load_digits", "environment": {"python": "3.11"}}
NOW = dt.datetime(2026, 9, 17, 12, 0, tzinfo=dt.timezone.utc).timestamp()       # a Thursday
WEEK = dt.datetime(2026, 9, 14, 0, 0, tzinfo=dt.timezone.utc).timestamp()       # its Monday
SWEEP = {"space": {"optim.lr": {"type": "float", "low": 0.002, "high": 0.05}}, "budget": {"max_cost_usd": 10}}


def _spec(team: str, **extra):
    tree = {"identity": {"experiment": f"{team}-exp", "owner": "tester", "team": team, "purpose": "budget test"},
            "recipe": {"name": "digits-cnn"}, "resources": {"work_pool": "gpu-a100", "procs_per_node": 8}, **extra}
    return load_spec_text(yaml.safe_dump(tree))


def _stage(c: MlflowClient, parent: str, stage: str, attempts: list[Attempt]) -> None:
    sid = runs.open_stage_run(c, parent, stage, request_key=f"{parent}-{stage}")
    result = StageResult(stage, Status.COMPLETED, attempts=[a.to_record() for a in attempts])
    runs.record_stage(c, sid, result, GateDecision(stage, True, []))


def _a(run: str, stage: str, n: int, slots: int, start: float, end: float, outcome=Outcome.COMPLETED, backoff=0.0):
    return Attempt(run, stage, n, "gpu-a100", slots, 2.5, start, end, outcome, backoff_s=backoff)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("budget")
    c = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    art = (tmp / "art").as_uri()
    # vision v1: full (8 slots, $2.5) from an hour before the week began to an hour after: $40, $20 of it this
    # week; a failed canary attempt this week (4 slots, 30 min + 10 min backoff): $6.6667.
    v1 = runs.open_pipeline_run(c, _spec("vision"), art, IDENTITY, request_key="v1")
    _stage(c, v1, "canary", [_a(v1, "canary", 0, 4, WEEK + 7200, WEEK + 9000, Outcome.FAILED, backoff=600)])
    _stage(c, v1, "full", [_a(v1, "full", 0, 8, WEEK - 3600, WEEK + 3600)])
    runs.close_pipeline_run(c, v1, True, "full")
    # vision v2, the run asking: smoke 1 h x 1 slot ($2.5), canary 1 h x 4 slots ($10), this week.
    v2_spec = _spec("vision", budget={"max_run_usd": 20}, sweep=SWEEP)
    v2 = runs.open_pipeline_run(c, v2_spec, art, IDENTITY, request_key="v2")
    _stage(c, v2, "smoke", [_a(v2, "smoke", 0, 1, NOW - 7200, NOW - 3600)])
    _stage(c, v2, "canary", [_a(v2, "canary", 0, 4, NOW - 3600, NOW)])
    # nlp n1: $1000 this week, another team's.
    n1 = runs.open_pipeline_run(c, _spec("nlp"), art, IDENTITY, request_key="n1")
    _stage(c, n1, "full", [_a(n1, "full", 0, 8, NOW - 50 * 3600, NOW)])
    # A sweep whose two trials recorded $3 and $4.
    exp = c.get_run(v2).info.experiment_id
    sweep = c.create_run(exp, run_name="sweep").info.run_id
    for cost in (3.0, 4.0):
        t = c.create_run(exp, tags={"mlflow.parentRunId": sweep}).info.run_id
        c.log_metric(t, "trial.cost_usd", cost)
    return {"c": c, "v2": v2, "v2_spec": v2_spec, "sweep": sweep}


TEAMS = {"vision": TeamBudget(budget_usd=100, period=Period.WEEK)}
TEAM_SPENT = 20 + 4 * 2.5 * 2400 / 3600 + 2.5 + 10           # 39.1667


def test_budget_left_per_run_sweep_and_team_equals_hand_computed_spend(store):
    got = budgets_for(store["c"], store["v2_spec"], store["v2"], NOW, TEAMS, sweep_run_id=store["sweep"])
    assert [(b.scope, b.limit_usd) for b in got] == [(Scope.RUN, 20), (Scope.SWEEP, 10), (Scope.TEAM, 100)]
    run, sweep, team = got
    assert run.spent_usd == pytest.approx(12.5) and run.left_usd == pytest.approx(7.5)
    assert sweep.spent_usd == pytest.approx(7.0) and sweep.left_usd == pytest.approx(3.0)
    assert team.spent_usd == pytest.approx(TEAM_SPENT) and team.period == "week from 2026-09-14 (UTC)"
    assert tightest(got) is sweep


def test_gate_refuses_the_next_stage_naming_each_budget_its_estimate_exceeds(store):
    budgets = budgets_for(store["c"], store["v2_spec"], store["v2"], NOW, TEAMS, sweep_run_id=store["sweep"])
    canary = StageResult("canary", Status.COMPLETED, estimate={"next_stage_cost_usd": 5.0})
    d = decide(canary, GateSpec(), budgets=budgets)
    assert not d.passed
    assert d.reasons == [f"estimated cost of full $5 exceeds what is left of the sweep budget of {store['sweep']}: "
                         "$3 ($7 of $10 spent); raise sweep.budget.max_cost_usd in the sweep's spec or lower "
                         "stages.full.max_steps"]
    canary.estimate["next_stage_cost_usd"] = 70.0
    d = decide(canary, GateSpec(), budgets=budgets)
    assert [r.split(":")[0] for r in d.reasons] == [
        f"estimated cost of full $70 exceeds what is left of the run budget of {store['v2']}",
        f"estimated cost of full $70 exceeds what is left of the sweep budget of {store['sweep']}",
        "estimated cost of full $70 exceeds what is left of the team budget of vision for the week from "
        "2026-09-14 (UTC)"]
    assert d.reasons[2].endswith("$60.8333 ($39.1667 of $100 spent); raise team_budgets.vision.budget_usd in the "
                                 "pools config, or wait for the next week or lower stages.full.max_steps")
    canary.estimate["next_stage_cost_usd"] = 2.0
    assert decide(canary, GateSpec(), budgets=budgets).passed


def test_the_stage_a_gate_decides_after_counts_before_it_is_recorded(store):
    full = _a(store["v2"], "full", 0, 8, NOW - 1800, NOW)   # $10, not in MLflow yet
    run, _, team = budgets_for(store["c"], store["v2_spec"], store["v2"], NOW, TEAMS, sweep_run_id=store["sweep"],
                               pending=[full])
    assert run.spent_usd == pytest.approx(22.5) and run.left_usd == 0.0
    assert team.spent_usd == pytest.approx(TEAM_SPENT + 10)


def test_a_team_budget_counts_only_the_team_and_only_this_period(store):
    nlp = _spec("nlp")
    [b] = budgets_for(store["c"], nlp, "some-run", NOW, {"nlp": TeamBudget(budget_usd=500, period=Period.DAY)})
    # n1 ran 50 h up to NOW (8 slots, $2.5): 12 h of it fall on today (UTC).
    assert b.spent_usd == pytest.approx(12 * 8 * 2.5) and b.left_usd == 260
    assert budgets_for(store["c"], nlp, "some-run", NOW, TEAMS) == []   # no nlp budget, no run budget


def test_no_budget_set_means_nothing_to_refuse(store):
    assert budget_left(run_id="r", team="t", runs=[], now=NOW) == []
    assert decide(StageResult("canary", Status.COMPLETED, estimate={"next_stage_cost_usd": 1e9}), GateSpec()).passed


def test_periods_start_at_the_utc_calendar_day_week_and_month():
    sunday_late = dt.datetime(2026, 9, 20, 23, 59, tzinfo=dt.timezone.utc).timestamp()
    assert period_start(Period.WEEK, sunday_late) == WEEK
    assert period_start(Period.DAY, WEEK) == WEEK
    assert period_start(Period.MONTH, WEEK) == dt.datetime(2026, 9, 1, tzinfo=dt.timezone.utc).timestamp()


def test_an_attempt_straddling_the_period_start_counts_its_held_time_inside_the_period():
    a = _a("r", "full", 0, 2, 0.0, 3000.0, backoff=600.0)        # held 0 .. 3600: $5
    assert spent_between([a], 1800.0, 10_000.0) == pytest.approx(2.5)
    assert spent_between([a], 3600.0, 10_000.0) == 0.0
    assert spent_between([a], 0.0, 900.0) == pytest.approx(1.25)


def test_a_team_budget_with_a_bad_period_is_refused_in_one_line():
    with pytest.raises(CapacityError) as e:
        parse_config({"pools": {"p": {"gpus_per_node": 1, "nodes": 1, "price_per_gpu_hour": 1, "worker": "process"}},
                      "team_budgets": {"vision": {"budget_usd": 10, "period": "fortnight"}}})
    assert "team_budgets.vision.period" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CapacityError, match="team_budgets.vision.budget_usd"):
        parse_config({"pools": {"p": {"gpus_per_node": 1, "nodes": 1, "price_per_gpu_hour": 1, "worker": "process"}},
                      "team_budgets": {"vision": {"budget_usd": 0, "period": "week"}}})


def test_sweep_spend_is_what_its_trials_recorded(store):
    assert sweep_spend_usd(store["c"], store["sweep"]) == pytest.approx(7.0)
