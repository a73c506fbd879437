"""The cost ledger and `traingate cost`: numbers equal to hand-computed values for a recorded set of
runs (restarts, backoff, preemption, idle start-up, a failed run, a run still going), read back from a
real MLflow SQLite store written by the same functions the ladder uses."""
from __future__ import annotations

import time

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows import cli
from traingate.cost import ledger
from traingate.cost.ledger import Attempt, Outcome
from traingate.cost.source import gather
from traingate.job.vocab import Cause, Status
from traingate.proc import ProcResult
from traingate.spec import load_spec_text
from traingate.stage import GateDecision, StageResult
from traingate.supervision.supervisor import Attempt as SupAttempt
from traingate.supervision.supervisor import Supervision
from traingate.tracking import runs

IDENTITY = {"code": {"sha": "0" * 40, "dirty": "false"}, "data_snapshot": "d" * 64,
            "data_uri": "sklearn://load_digits", "environment": {"python": "3.11"}}
T0 = 1_790_000_000.0


def _spec(experiment: str, team: str, pool: str, nodes: int, nproc: int):
    tree = {"identity": {"experiment": experiment, "owner": "tester", "team": team, "purpose": "cost ledger test"},
            "recipe": {"name": "digits-cnn"},
            "resources": {"work_pool": pool, "nodes": nodes, "procs_per_node": nproc,
                          **({"rdzv_endpoint": "head:29500"} if nodes > 1 else {})}}
    return load_spec_text(yaml.safe_dump(tree))


def _att(n: int, start: float, end: float, first: float | None, cause: Cause | None = None,
         backoff: float = 0.0) -> SupAttempt:
    return SupAttempt(number=n, launched_at=T0 + start, ended_at=T0 + end,
                      first_step_time=None if first is None else T0 + first, cause=cause, backoff_s=backoff)


def _record(c: MlflowClient, parent: str, stage: str, attempts: list[SupAttempt] | None, status=Status.COMPLETED):
    sid = runs.open_stage_run(c, parent, stage, request_key=f"{parent}-{stage}")
    if attempts is None:
        return  # still running: no result yet
    details = {}
    if stage != "unit":  # pytest runs unsupervised
        details["supervision"] = Supervision(status, attempts[-1].cause, None, attempts, ProcResult(0, 1.0)).to_dict()
    result = StageResult(stage, status, metrics={"restarts": max(0, len(attempts) - 1)}, duration_s=1.0,
                         details=details)
    runs.record_stage(c, sid, result, GateDecision(stage, status == Status.COMPLETED, []))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Four runs in a real MLflow store; the first two (family vision-a) before ``cutoff_ms``."""
    tmp_path = tmp_path_factory.mktemp("cost")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    art = (tmp_path / "art").as_uri()

    # vision-a, gpu-a100 ($2.5 per slot-hour), canary 4 slots, full 2 nodes x 4 = 8 slots. Passed.
    a1 = runs.open_pipeline_run(c, _spec("vision-a", "vision", "gpu-a100", 2, 4), art, IDENTITY, request_key="a1")
    _record(c, a1, "unit", [])  # no attempts: pytest takes no pool slots
    _record(c, a1, "smoke", [_att(0, 0, 360, 60)])
    _record(c, a1, "canary", [_att(0, 0, 1800, 120, Cause.WORKER_LOST, backoff=30), _att(1, 1830, 5430, 1920)])
    _record(c, a1, "full", [_att(0, 0, 3600, 300, Cause.PREEMPTED), _att(1, 3600, 10800, 3800)])
    runs.close_pipeline_run(c, a1, True, "full")
    # vision-a again: diverged in canary (one attempt, not retried). Failed.
    a2 = runs.open_pipeline_run(c, _spec("vision-a", "vision", "gpu-a100", 2, 4), art, IDENTITY, request_key="a2")
    _record(c, a2, "smoke", [_att(0, 0, 360, 60)])
    _record(c, a2, "canary", [_att(0, 0, 600, 100, Cause.DIVERGED)], status=Status.DIVERGED)
    runs.close_pipeline_run(c, a2, False, "canary", "diverged")
    time.sleep(0.01)
    cutoff_ms = int(time.time() * 1000)
    time.sleep(0.01)
    # text-b, cpu-local ($0.05), one node x 2. Passed; and one still in its smoke stage.
    b1 = runs.open_pipeline_run(c, _spec("text-b", "nlp", "cpu-local", 1, 2), art, IDENTITY, request_key="b1")
    _record(c, b1, "smoke", [_att(0, 0, 100, 10)])
    _record(c, b1, "canary", [_att(0, 0, 200, 10)])
    _record(c, b1, "full", [_att(0, 0, 400, 10)])
    runs.close_pipeline_run(c, b1, True, "full")
    b2 = runs.open_pipeline_run(c, _spec("text-b", "nlp", "cpu-local", 1, 2), art, IDENTITY, request_key="b2")
    _record(c, b2, "smoke", None)
    return {"uri": uri, "client": c, "cutoff_ms": cutoff_ms, "ids": {"a1": a1, "a2": a2, "b1": b1, "b2": b2}}


# Hand-computed. vision-a, a1: smoke 360 s x 1 slot; canary 1830 s (1800 + 30 backoff, lost) + 3600 s x 4;
# full 3600 s (preempted, lost) + 7200 s x 8. a2: smoke 360 s x 1; canary 600 s x 4 (lost).
A1_SLOT_H = 360 / 3600 + 1830 * 4 / 3600 + 3600 * 4 / 3600 + 3600 * 8 / 3600 + 7200 * 8 / 3600   # 30.1333
A2_SLOT_H = 360 / 3600 + 600 * 4 / 3600                                                           # 0.7667
A_LOST_H = 1830 * 4 / 3600 + 3600 * 8 / 3600 + 600 * 4 / 3600                                     # 10.7
# Idle: launch to first step. a1: 60x1, 120x4, 90x4, 300x8, 200x8; a2: 60x1, 100x4 (slot-seconds).
A_IDLE_H = (60 + 120 * 4 + 90 * 4 + 300 * 8 + 200 * 8 + 60 + 100 * 4) / 3600                       # 1.4889
B_SLOT_H = (100 * 1 + 200 * 2 + 400 * 2) / 3600
B_IDLE_H = (10 * 1 + 10 * 2 + 10 * 2) / 3600


def test_report_numbers_equal_hand_computed_values_for_recorded_runs(store):
    got = gather(store["client"])
    r = ledger.report(got.runs)
    a, b = r.families["vision-a"], r.families["text-b"]
    assert (a.runs, a.successful_runs, b.runs, b.successful_runs) == (2, 1, 2, 1)
    assert a.totals.attempts == 7 and a.totals.unfinished_attempts == 3
    assert a.totals.slot_hours == pytest.approx(A1_SLOT_H + A2_SLOT_H)
    assert a.totals.usd == pytest.approx((A1_SLOT_H + A2_SLOT_H) * 2.5)          # $77.25
    assert a.totals.usd == pytest.approx(77.25)
    assert a.totals.lost_usd == pytest.approx(A_LOST_H * 2.5) == pytest.approx(26.75)
    assert a.totals.idle_share == pytest.approx(A_IDLE_H / (A1_SLOT_H + A2_SLOT_H))
    assert a.cost_per_successful_run == pytest.approx(77.25)
    assert b.totals.usd == pytest.approx(B_SLOT_H * 0.05) and b.totals.lost_usd == 0
    assert b.totals.idle_slot_hours == pytest.approx(B_IDLE_H)
    assert b.cost_per_successful_run == pytest.approx(B_SLOT_H * 0.05)
    assert r.by_team["vision"].usd == pytest.approx(77.25) and set(r.by_team) == {"vision", "nlp"}
    assert r.total.usd == pytest.approx(77.25 + B_SLOT_H * 0.05)
    # The unit stage takes no slots; the stage still running has no result to charge yet.
    assert {c.attempt.stage for c in r.charges} == {"smoke", "canary", "full"}
    assert got.skipped == [f"{store['ids']['b2']}/smoke: no stage/result.json (still running, or its orchestrator died)"]


def test_each_attempt_is_charged_its_slots_price_backoff_and_outcome(store):
    got = gather(store["client"], experiment="vision-a")
    a1 = next(run for run in got.runs if run.run_id == store["ids"]["a1"])
    canary = [a for a in a1.attempts if a.stage == "canary"]
    assert [(a.slots, a.price_per_slot_hour, a.pool, a.outcome, a.backoff_s, a.idle_s) for a in canary] == [
        (4, 2.5, "gpu-a100", Outcome.FAILED, 30.0, 120.0), (4, 2.5, "gpu-a100", Outcome.COMPLETED, 0.0, 90.0)]
    full = [ledger.charge(a) for a in a1.attempts if a.stage == "full"]
    assert [(c.attempt.slots, c.attempt.outcome) for c in full] == [(8, Outcome.PREEMPTED), (8, Outcome.COMPLETED)]
    assert [round(c.usd, 6) for c in full] == [20.0, 40.0]
    assert [round(c.lost_usd, 6) for c in full] == [20.0, 0.0]


def test_filters_by_team_experiment_and_age(store):
    c = store["client"]
    assert {r.experiment for r in gather(c, team="nlp").runs} == {"text-b"}
    assert {r.run_id for r in gather(c, experiment="vision-a").runs} == {store["ids"]["a1"], store["ids"]["a2"]}
    assert {r.experiment for r in gather(c, since_ms=store["cutoff_ms"]).runs} == {"text-b"}
    assert gather(c, team="nobody").runs == []
    with pytest.raises(ValueError, match="experiment = 'nope': no such experiment"):
        gather(c, experiment="nope")


def test_cost_command_prints_the_hand_computed_report(store, monkeypatch, capsys):
    monkeypatch.setenv("TRAINGATE_TRACKING_URI", store["uri"])
    assert cli.main(["cost", "--team", "vision"]) == 0
    out = capsys.readouterr().out
    assert "cost: team vision (2 runs)" in out
    assert "7 attempts (3 failed or preempted), 30.9000 slot-hours, $77.25; lost to failures and backoff $26.75 " \
           "(34.6%); idle $3.72 (4.8%)" in out
    assert "| vision-a | 7 | 30.9000 | $77.25 | $26.75 | 34.6% | 4.8% | 1/2 | $77.25 |" in out
    assert "text-b" not in out


def test_cost_command_refuses_a_bad_since_and_team_in_one_line(store, monkeypatch, capsys):
    monkeypatch.setenv("TRAINGATE_TRACKING_URI", store["uri"])
    assert cli.main(["cost", "--since", "7 days"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "traingate cost: --since = '7 days': give a positive age with a unit s, m, h, d or w, " \
                          "e.g. 7d or 12h"
    assert cli.main(["cost", "--team", "x' or '1'='1"]) == 2
    assert capsys.readouterr().err.startswith("traingate cost: --team = \"x' or '1'='1\": must be 1-")


def test_a_family_without_a_successful_run_has_no_cost_per_success():
    a = Attempt("r", "canary", 0, "cpu-local", 2, 0.05, 0.0, 3600.0, Outcome.FAILED)
    r = ledger.report([ledger.Run("r", "e", "t", False, (a,))])
    assert r.families["e"].cost_per_successful_run is None
    assert r.families["e"].totals.lost_usd == pytest.approx(0.1)
    assert "| e | 1 | 2.0000 | $0.1000 | $0.1000 | 100.0% | 0.0% | 0/1 | - |" in ledger.render(r)


def test_an_attempt_that_cannot_be_charged_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"attempt 0 of r/full: end = 1 is before start = 2"):
        Attempt("r", "full", 0, "p", 1, 1.0, 2.0, 1.0, Outcome.COMPLETED)
    with pytest.raises(ValueError, match=r"idle_s = 5: needs 0 \.\. end - start \(1\)"):
        Attempt("r", "full", 0, "p", 1, 1.0, 0.0, 1.0, Outcome.COMPLETED, idle_s=5)
    with pytest.raises(ValueError, match="slots = 0: needs >= 1"):
        Attempt("r", "full", 0, "p", 0, 1.0, 0.0, 1.0, Outcome.COMPLETED)
