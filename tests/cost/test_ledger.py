"""The cost ledger and `traingate cost`: numbers equal to hand-computed values for a recorded set of
runs (restarts, backoff, preemption, idle start-up, a failed run, a run still going), read back from a
real MLflow SQLite store written by the same functions the ladder uses."""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows import cli
from traingate.ladder import outcomes
from traingate.cost import ledger
from traingate.cost.ledger import Attempt, Outcome
from traingate.cost.source import gather
from traingate.job import files
from traingate.job.stagejob import derive
from traingate.job.vocab import Cause, Status
from traingate.launch.proc import ProcResult
from traingate.settings import Settings
from traingate.spec import load_spec_text
from traingate.job.result import GateDecision, StageResult
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
    # speech-c, gpu-h100 ($4), one node x 4, recorded through from_supervision as the launch task does:
    # smoke's stop-and-resume, a canary restart with backoff, a full stage resumed after a preemption.
    spec = _spec("speech-c", "speech", "gpu-h100", 1, 4)
    c1 = runs.open_pipeline_run(c, spec, art, IDENTITY, request_key="c1")
    run_dir = tmp_path / "runs" / "c1"
    _record_job(c, c1, spec, run_dir, "smoke", [_att(0, 110, 200, 130)], before=[[_att(0, 0, 100, 20)]],
                profile={"samples_per_s": 100.0})
    _record_job(c, c1, spec, run_dir, "canary", [_att(0, 0, 300, 10, Cause.WORKER_LOST, backoff=20),
                                                 _att(1, 320, 620, 340)],
                profile={"step_time_mean_s": 0.5, "startup_s": 10.0, "samples_per_s": 300.0})
    _record_job(c, c1, spec, run_dir, "full", [_att(0, 600, 1600, 700)],
                earlier=[_att(0, 0, 500, 50, Cause.PREEMPTED, backoff=40)])
    runs.close_pipeline_run(c, c1, True, "full")
    return {"uri": uri, "client": c, "cutoff_ms": cutoff_ms, "ids": {"a1": a1, "a2": a2, "b1": b1, "b2": b2, "c1": c1}}


def _record_job(c: MlflowClient, parent: str, spec, run_dir, stage: str, attempts: list[SupAttempt],
                before: list[list[SupAttempt]] = (), earlier: list[SupAttempt] = (), profile: dict | None = None):
    """A stage result made by outcomes.from_supervision from the stage directory the supervisor leaves:
    supervisor.json (an interrupted supervision's attempts before this one's) and result.json."""
    job = derive(spec, stage, run_id=parent, run_dir=run_dir, settings=Settings.from_env(),
                 checkpoint_uri=(run_dir / "ck").as_uri())
    stage_dir = Path(job.stage_dir)
    stage_dir.mkdir(parents=True)
    files.write_supervisor_state(stage_dir, files.SupervisorState(attempts=[asdict(a) for a in [*earlier, *attempts]]))
    files.write_result(stage_dir, files.RuntimeResult(Status.COMPLETED, 0, steps_done=10,
                                                      metrics={"profile": profile or {}}))
    sup = Supervision(Status.COMPLETED, None, None, attempts, ProcResult(0, 1.0))
    firsts = [Supervision(Status.COMPLETED, None, None, b, ProcResult(0, 1.0)) for b in before]
    result = outcomes.from_supervision(job, sup, 1.0, before=firsts)
    sid = runs.open_stage_run(c, parent, stage, request_key=f"{parent}-{stage}")
    runs.record_stage(c, sid, result, GateDecision(stage, True, []))
    return result


# Hand-computed. vision-a, a1: smoke 360 s x 1 slot; canary 1830 s (1800 + 30 backoff, lost) + 3600 s x 4;
# full 3600 s (preempted, lost) + 7200 s x 8. a2: smoke 360 s x 1; canary 600 s x 4 (lost).
A1_SLOT_H = 360 / 3600 + 1830 * 4 / 3600 + 3600 * 4 / 3600 + 3600 * 8 / 3600 + 7200 * 8 / 3600   # 30.1333
A2_SLOT_H = 360 / 3600 + 600 * 4 / 3600                                                           # 0.7667
A_LOST_H = 1830 * 4 / 3600 + 3600 * 8 / 3600 + 600 * 4 / 3600                                     # 10.7
# Idle: launch to first step. a1: 60x1, 120x4, 90x4, 300x8, 200x8; a2: 60x1, 100x4 (slot-seconds).
A_IDLE_H = (60 + 120 * 4 + 90 * 4 + 300 * 8 + 200 * 8 + 60 + 100 * 4) / 3600                       # 1.4889
B_SLOT_H = (100 * 1 + 200 * 2 + 400 * 2) / 3600
B_IDLE_H = (10 * 1 + 10 * 2 + 10 * 2) / 3600
# speech-c, c1, $4 per slot-hour. smoke (1 slot): part 1 100 s + part 2 90 s, 20 s idle each. canary (4 slots):
# 300 s + 20 s backoff (lost, 10 s idle), then 300 s (20 s idle). full (4 slots): an earlier supervision's
# 500 s + 40 s backoff (preempted, lost, 50 s idle), then 1000 s (100 s idle).
C_SLOT_S = (100 + 90) * 1 + (320 + 300) * 4 + (540 + 1000) * 4                                 # 8830
C_LOST_S = 320 * 4 + 540 * 4                                                                    # 3440
C_IDLE_S = (20 + 20) * 1 + (10 + 20) * 4 + (50 + 100) * 4                                       # 760
C_FULL_USD = 1540 * 4 / 3600 * 4                                                                # $6.8444
C_FULL_ESTIMATE_USD = (10 + 200 * 0.5) * 4 / 3600 * 4  # canary's profile: 10 s start-up, 0.5 s x 200 steps


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
    assert r.by_team["vision"].usd == pytest.approx(77.25) and set(r.by_team) == {"vision", "nlp", "speech"}
    assert r.total.usd == pytest.approx(77.25 + B_SLOT_H * 0.05 + C_SLOT_S / 3600 * 4)
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


def test_smoke_stop_and_resume_restarts_backoff_and_a_resumed_stage_are_charged_exactly(store):
    r = ledger.report(gather(store["client"], experiment="speech-c").runs)
    c = r.families["speech-c"]
    assert c.totals.attempts == 6 and c.totals.unfinished_attempts == 2
    assert c.totals.slot_hours == pytest.approx(C_SLOT_S / 3600)
    assert c.totals.usd == pytest.approx(C_SLOT_S / 3600 * 4) == pytest.approx(9.811111)
    assert c.totals.lost_usd == pytest.approx(C_LOST_S / 3600 * 4) == pytest.approx(3.822222)
    assert c.totals.idle_slot_hours == pytest.approx(C_IDLE_S / 3600)
    assert c.cost_per_successful_run == pytest.approx(9.811111)
    smoke = [ch for ch in r.charges if ch.attempt.stage == "smoke"]
    assert [(ch.attempt.number, ch.attempt.start - T0, ch.attempt.end - T0, ch.attempt.idle_s) for ch in smoke] == [
        (0, 0.0, 100.0, 20.0), (1, 110.0, 200.0, 20.0)]
    assert (c.full_estimated_runs, c.full_actual_usd) == (1, pytest.approx(C_FULL_USD))
    assert c.full_estimated_usd == pytest.approx(C_FULL_ESTIMATE_USD) == pytest.approx(0.488889)


def test_a_stage_result_records_each_attempt_with_its_charge(store):
    c = store["client"]
    [full] = c.search_runs([c.get_run(store["ids"]["c1"]).info.experiment_id],
                           f"tags.mlflow.parentRunId = '{store['ids']['c1']}' and tags.`traingate.stage` = 'full'")
    result = json.loads(Path(c.download_artifacts(full.info.run_id, "stage/result.json")).read_text())
    assert result["attempts"] == [
        {"stage": "full", "number": 0, "pool": "gpu-h100", "slots": 4, "price_per_slot_hour": 4.0, "start": T0,
         "end": T0 + 500, "held_s": 540.0, "backoff_s": 40.0, "idle_s": 50.0, "outcome": "preempted",
         "usd": pytest.approx(540 * 4 / 3600 * 4)},
        {"stage": "full", "number": 1, "pool": "gpu-h100", "slots": 4, "price_per_slot_hour": 4.0, "start": T0 + 600,
         "end": T0 + 1600, "held_s": 1000.0, "backoff_s": 0.0, "idle_s": 100.0, "outcome": "completed",
         "usd": pytest.approx(1000 * 4 / 3600 * 4)}]
    assert result["estimated_cost_usd"] == pytest.approx(C_FULL_ESTIMATE_USD)


def test_filters_by_team_experiment_and_age(store):
    c = store["client"]
    assert {r.experiment for r in gather(c, team="nlp").runs} == {"text-b"}
    assert {r.run_id for r in gather(c, experiment="vision-a").runs} == {store["ids"]["a1"], store["ids"]["a2"]}
    assert {r.experiment for r in gather(c, since_ms=store["cutoff_ms"]).runs} == {"text-b", "speech-c"}
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


def test_cost_command_shows_the_canary_estimate_of_full_beside_its_actual_cost(store, monkeypatch, capsys):
    monkeypatch.setenv("TRAINGATE_TRACKING_URI", store["uri"])
    assert cli.main(["cost", "--experiment", "speech-c"]) == 0
    out = capsys.readouterr().out
    assert "| experiment | attempts | slot-hours | spend | lost | lost share | idle share | succeeded | " \
           "cost per successful run | full: canary estimate / actual |" in out
    assert "| speech-c | 6 | 2.4528 | $9.81 | $3.82 | 39.0% | 8.6% | 1/1 | $9.81 | $0.4889 / $6.84 (x14.00) |" in out
    # Smoke at 1 process 100 samples/s, canary at 4: 300 samples/s, $4 per slot-hour: efficiency 300 / (4 x 100).
    assert f"- speech-c (run {store['ids']['c1']}): 4 processes: 3.00x the throughput of 1 (scaling efficiency " \
           "75%); a sample costs 1.33x as much ($14.8148 vs $11.1111 per 1M samples at $4.00 per slot-hour): " \
           "adding processes still pays off (efficiency >= 75%)." in out


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
