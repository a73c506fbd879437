"""One ledger: `traingate runs`, `traingate cost`, `traingate watch` and the MLflow run show the same
total for the same run, to the cent. A run is recorded in a real state directory and a real MLflow
SQLite store the way the launch task records it (supervisor.json, charged.json, the StageResult
from outcomes.from_supervision): smoke's stop-and-resume, a canary restart with backoff, a full
stage resumed after a preemption. Also: the start and duration columns of `runs` and `queue`."""
from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows import cli
from flows.cli.queue import render as render_queue
from traingate.capacity.pools import parse_config
from traingate.capacity.queue import RUNNING, Entry
from traingate.cost import charged
from traingate.job import files
from traingate.job.result import GateDecision
from traingate.job.stagejob import derive
from traingate.job.vocab import Cause, Status
from traingate.ladder import outcomes
from traingate.launch.proc import ProcResult
from traingate.monitor import dashboard
from traingate.settings import Settings
from traingate.spec import load_spec_text
from traingate.supervision.supervisor import Attempt as SupAttempt
from traingate.supervision.supervisor import Supervision
from traingate.tracking import browse, runs
from traingate.units import usd, utc

IDENTITY = {"code": {"sha": "0" * 40, "dirty": "false"}, "data_snapshot": "d" * 64,
            "data_uri": "sklearn://load_digits", "environment": {"python": "3.11"}}
T0 = 1_790_000_000.0
# gpu-h100 at $4 per slot-hour, one node x 4 processes: smoke takes 1 slot, canary and full 4.
# smoke: part 1 100 s + part 2 90 s (x 1); canary: 300 s + 20 s backoff, then 300 s (x 4);
# full: a preempted supervision's 500 s + 40 s backoff, then 1000 s (x 4).
SMOKE_FIRST_USD = 100 / 3600 * 1 * 4
TOTAL_USD = ((100 + 90) * 1 + (320 + 300) * 4 + (540 + 1000) * 4) / 3600 * 4  # $9.8111


def _att(n: int, start: float, end: float, cause: Cause | None = None, backoff: float = 0.0) -> SupAttempt:
    return SupAttempt(number=n, launched_at=T0 + start, ended_at=T0 + end, first_step_time=T0 + start + 10,
                      cause=cause, backoff_s=backoff)


def _supervised(stage_dir: Path, attempts: list[SupAttempt], final: bool = True) -> None:
    files.write_supervisor_state(stage_dir, files.SupervisorState(
        attempts=[asdict(a) for a in attempts], final={"status": "completed"} if final else None))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A passed run of speech-c, recorded stage by stage as the launch task records it."""
    state = tmp_path_factory.mktemp("ledger")
    uri = f"sqlite:///{state / 'mlflow.db'}"
    c = MlflowClient(uri)
    tree = {"identity": {"experiment": "speech-c", "owner": "tester", "team": "speech", "purpose": "one ledger"},
            "recipe": {"name": "digits-cnn"}, "resources": {"work_pool": "gpu-h100", "nodes": 1, "procs_per_node": 4}}
    spec = load_spec_text(yaml.safe_dump(tree))
    rid = runs.open_pipeline_run(c, spec, (state / "art").as_uri(), IDENTITY, request_key="one-ledger")
    run_dir = state / "runs" / rid
    run_dir.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(spec.to_dict()))
    live = {}

    def stage(name, attempts, earlier=(), first_half=()):
        job = derive(spec, name, run_id=rid, run_dir=run_dir, settings=Settings.from_env(),
                     checkpoint_uri=(run_dir / "ck").as_uri())
        job.write()
        stage_dir = Path(job.stage_dir)
        files.write_result(stage_dir, files.RuntimeResult(Status.COMPLETED, 0, steps_done=10, metrics={}))
        before = []
        if first_half:  # smoke's first half ends; its charge goes to charged.json as stage_run.train writes it
            _supervised(stage_dir, list(first_half))
            before = [Supervision(Status.COMPLETED, None, None, list(first_half), ProcResult(0, 1.0))]
            charged.record(stage_dir, [a.to_record() for a in outcomes.charged_attempts(job, before[0])], final=False)
            # The second half runs: its supervisor.json holds only its own attempts, the launch open.
            running = SupAttempt(number=0, launched_at=attempts[0].launched_at)
            _supervised(stage_dir, [running], final=False)
            live["smoke_running"] = charged.stage_usd(stage_dir, now=attempts[0].launched_at + 45)
        _supervised(stage_dir, [*earlier, *attempts])
        sup = Supervision(Status.COMPLETED, None, None, attempts, ProcResult(0, 1.0))
        result = outcomes.from_supervision(job, sup, 12345.0, before=before)  # the task's wall time is not charged
        charged.record(stage_dir, result.attempts, final=True)
        sid = runs.open_stage_run(c, rid, name, request_key=f"{rid}-{name}")
        runs.record_stage(c, sid, result, GateDecision(name, True, []))

    stage("smoke", [_att(0, 110, 200)], first_half=[_att(0, 0, 100)])
    stage("canary", [_att(0, 0, 300, Cause.WORKER_LOST, backoff=20), _att(1, 320, 620)])
    stage("full", [_att(0, 600, 1600)], earlier=[_att(0, 0, 500, Cause.PREEMPTED, backoff=40)])
    runs.close_pipeline_run(c, rid, True, "full")
    return {"uri": uri, "client": c, "state": state, "run_id": rid, "run_dir": run_dir, "live": live}


@pytest.fixture
def env(recorded, monkeypatch):
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(recorded["state"]))
    monkeypatch.setenv("TRAINGATE_TRACKING_URI", recorded["uri"])
    return recorded


def test_runs_cost_watch_and_the_mlflow_run_show_the_same_total_to_the_cent(env, capsys):
    rid, want = env["run_id"], usd(TOTAL_USD)
    assert want == "$9.81"
    pipeline = env["client"].get_run(rid)
    # The MLflow run: traingate's metric and the headline one MLflow's run table shows.
    assert usd(pipeline.data.metrics["pipeline.cost_usd"]) == usd(pipeline.data.metrics["cost_usd"]) == want

    assert cli.main(["runs"]) == 0
    table = capsys.readouterr().out.splitlines()
    cost_col = table[0].index("COST")
    [row] = [line for line in table if line.startswith(rid)]
    assert row[cost_col:].split()[0] == want

    assert cli.main(["cost", "--run", rid]) == 0
    out = capsys.readouterr().out
    assert f"cost: run {rid} (1 runs)" in out
    assert re.search(r"6 attempts \(2 failed or preempted\), [\d.]+ slot-hours, (\$[\d.,]+);", out).group(1) == want

    assert cli.main(["watch", rid, "--once"]) == 0
    screen = capsys.readouterr().out
    assert re.search(r"cost\s+(\S+) so far", screen).group(1) == want
    assert dashboard.summary_line(dashboard.read_snapshot(env["run_dir"])).endswith(f", {want} spent")

    assert cli.main(["show", rid]) == 0
    assert f"cost: {want}" in capsys.readouterr().out


def test_the_task_wall_time_is_not_charged_only_the_attempts(env):
    # from_supervision was handed a 12345 s stage wall time: a stage's cost is its attempts, not that.
    c, rid = env["client"], env["run_id"]
    stage_costs = {s.data.tags["traingate.stage"]: s.data.metrics["stage.cost_usd"] for s in runs.stage_runs(c, rid)}
    assert stage_costs == {"smoke": pytest.approx(190 / 3600 * 4), "canary": pytest.approx(620 * 4 / 3600 * 4),
                           "full": pytest.approx(1540 * 4 / 3600 * 4)}
    assert {d.name: charged.stage_usd(d) for d in env["run_dir"].iterdir() if d.is_dir()} == pytest.approx(stage_costs)


def test_watch_counts_smokes_first_half_while_its_second_half_runs(env):
    # 100 s of the first half and 45 s of the running second half, 1 slot at $4 per slot-hour.
    assert env["live"]["smoke_running"] == pytest.approx(SMOKE_FIRST_USD + 45 / 3600 * 4)


def test_a_resumed_stage_is_charged_from_its_new_supervision_not_the_earlier_final_charge(env, tmp_path):
    d = tmp_path / "full"
    d.mkdir()
    files.write_json(d / files.JOB, {"run_id": "r", "stage": "full", "pool": "p", "slots": 2,
                                     "price_per_slot_hour": 3.6, "launched_at": 1000.0})
    _supervised(d, [_att(0, 0, 100, Cause.PREEMPTED)])
    charged.record(d, [{"stage": "full", "number": 0, "pool": "p", "slots": 2, "price_per_slot_hour": 3.6,
                        "start": T0, "end": T0 + 100, "backoff_s": 0.0, "idle_s": 10.0, "outcome": "preempted"}],
                   final=True)
    assert charged.stage_usd(d) == pytest.approx(0.2)  # 100 s x 2 slots x $3.60/h
    # `traingate resume`: the new supervision holds the earlier attempt and a launch running for 50 s.
    files.write_json(d / files.JOB, {"run_id": "r", "stage": "full", "pool": "p", "slots": 2,
                                     "price_per_slot_hour": 3.6, "launched_at": T0 + 200})
    _supervised(d, [_att(0, 0, 100, Cause.PREEMPTED), SupAttempt(number=1, launched_at=T0 + 200)], final=False)
    assert charged.stage_usd(d, now=T0 + 250) == pytest.approx(0.3)


def test_cost_refuses_an_unknown_run_and_run_with_other_filters_in_one_line(env, capsys):
    assert cli.main(["cost", "--run", "nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "traingate cost: --run = 'nope': no pipeline run with this id; `traingate runs` lists them")
    assert cli.main(["cost", "--run", env["run_id"], "--team", "speech"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"traingate cost: --run = '{env['run_id']}' names one run: leave --team, --experiment and --since out")


def test_runs_shows_start_in_utc_and_duration_to_the_end_or_up_to_now(tmp_path):
    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = c.create_experiment("columns")
    start_ms = int(T0 * 1000)
    done = c.create_run(exp, start_time=start_ms, tags={"traingate.kind": "pipeline"}, run_name="done").info.run_id
    c.set_terminated(done, "FINISHED", end_time=start_ms + 3_723_000)
    going = c.create_run(exp, start_time=start_ms + 60_000, tags={"traingate.kind": "pipeline"},
                         run_name="going").info.run_id
    rows = browse.list_runs(c, now=T0 + 60 + 125)
    text = browse.render_runs(rows, None).splitlines()
    head = text[0]
    assert "START (UTC)" in head and "DURATION" in head
    start_col, dur_col = head.index("START (UTC)"), head.index("DURATION")
    by_id = {line.split()[0]: line for line in text[1:]}
    assert by_id[done][start_col:].startswith(utc(T0)) and utc(T0) == "2026-09-21 14:13:20"
    assert by_id[done][dur_col:].split()[0] == "1:02:03"  # start to end
    assert by_id[going][start_col:].startswith("2026-09-21 14:14:20")
    assert by_id[going][dur_col:].split()[0] == "2:05"  # still running: up to now


def test_queue_shows_when_each_job_started_or_was_queued_in_utc_and_for_how_long():
    cfg = parse_config({"pools": {"p": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 1.0,
                                        "worker": "process"}}})
    running = Entry("a-full", "a", "full", "t1", "research", "p", 2, submit_s=T0 - 30, state=RUNNING,
                    started_s=T0, progress="step 40/100")
    waiting = Entry("b-full", "b", "full", "t2", "research", "p", 1, submit_s=T0 + 3600)
    out = render_queue(cfg, [running, waiting], {}, now=T0 + 3723 + 0.2)
    lines = out.splitlines()
    assert re.search(r"running  a-full .* started 2026-09-21 14:13:20 UTC  for  1:02:03  step 40/100$", lines[1]), out
    assert re.search(r"#1 .* b-full .* queued  2026-09-21 15:13:20 UTC  waited  2:03  start ", lines[2]), out
