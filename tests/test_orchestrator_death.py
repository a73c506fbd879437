"""The orchestrator dies: the `traingate run` CLI is SIGKILLed (or a rank is) at seeded-random moments.

Real everything: the CLI subprocess on the session's Prefect server (a server outlives the CLI, as in
production), MLflow on SQLite, torchrun trees of 2 gloo ranks. Afterwards no process of the run
outlives the grace period, `traingate resume` finishes the pipeline (parent run closed, model
registered) and no MLflow run is left RUNNING; the killed flow run is Crashed.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from tgtest import PYTHON, ROOT, describe, run_processes

pytestmark = pytest.mark.slow

GRACE_S = 30
# Long enough stages (rank 0 sleeps 0.1 s a step) that a kill lands inside them, not between them.
LONGER = ["--set", "stages.smoke.max_steps=20", "--set", "stages.canary.max_steps=30",
          "--set", "stages.full.max_steps=30", "--set", "supervision.backoff_base_s=0.2"]
SLOW = {"TRAINGATE_INJECT": "slow@0:0"}


class Cli:
    """`traingate run` (or resume) in a subprocess with its own state dir and Prefect home, on the Prefect
    server that ``prefect_api`` names."""

    def __init__(self, tmp: Path, prefect_api: dict[str, str], env_extra: dict[str, str] | None = None):
        self.tmp = tmp
        self.state = tmp / "state"
        self.env = {**os.environ, "TRAINGATE_STATE_DIR": str(self.state), "PREFECT_HOME": str(tmp / "prefect"),
                    "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **prefect_api, **(env_extra or {})}
        self.proc: subprocess.Popen | None = None
        self.out = tmp / "run.out"
        self.family: set[int] = set()

    def start(self, *args: str) -> subprocess.Popen:
        # Its own session: SIGKILL hits the CLI alone (as `kill -9 PID` would), and the test can
        # clean up whatever the CLI itself started afterwards.
        self.proc = subprocess.Popen([PYTHON, "-m", "flows.cli", *args], cwd=ROOT, env=self.env,
                                     stdout=open(self.out, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        return self.proc

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        env = {k: v for k, v in self.env.items() if k != "TRAINGATE_INJECT"}
        return subprocess.run([PYTHON, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)

    def run_dir(self) -> Path | None:
        dirs = list((self.state / "runs").glob("*")) if (self.state / "runs").is_dir() else []
        return dirs[0] if dirs else None

    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def cleanup(self) -> None:
        """Stop whatever the CLI left behind in its session."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait(predicate: Callable[[], Any], timeout_s: float, what: str, cli: Cli | None = None) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if cli is not None and cli.proc is not None and cli.proc.poll() is not None:
            raise AssertionError(f"the CLI exited ({cli.proc.returncode}) while waiting for {what}:\n"
                                 + cli.output()[-3000:])
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n" + (cli.output()[-3000:] if cli else ""))


def _beat(stage_dir: Path, rank: int = 0) -> dict[str, Any] | None:
    try:
        return json.loads((stage_dir / f"heartbeat.rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def _at_step(cli: Cli, stage: str, step: int) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        run_dir = cli.run_dir()
        beat = _beat(run_dir / stage) if run_dir else None
        return beat if beat and beat["step"] >= step and beat.get("phase", "train") == "train" else None
    return check


def _heartbeat_pids(run_dir: Path) -> set[int]:
    pids = set()
    for f in run_dir.glob("*/heartbeat.rank*.json"):
        try:
            pids.add(int(json.loads(f.read_text())["pid"]))
        except (OSError, ValueError, KeyError):
            continue
    return pids


def _flow_run_state(flow_run_id: str) -> str:
    """The flow run's state type as the session's Prefect server (``prefect_api``'s) holds it."""
    from prefect import get_client

    with get_client(sync_client=True) as c:
        return c.read_flow_run(flow_run_id).state.type.value


def _mlflow(cli: Cli) -> MlflowClient:
    return MlflowClient(f"sqlite:///{cli.state / 'mlflow.db'}")


def _assert_resumed_to_the_end(cli: Cli, run_id: str) -> subprocess.CompletedProcess:
    p = cli.run("resume", run_id)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert "resume PASSED" in p.stdout and "model:           models:/" in p.stdout, p.stdout[-3000:]
    c = _mlflow(cli)
    exps = [e.experiment_id for e in c.search_experiments()]
    runs = c.search_runs(exps, f"tags.`traingate.run_id` = '{run_id}'")
    assert runs, "no MLflow run of the pipeline"
    assert [r.info.run_id for r in runs if r.info.status == "RUNNING"] == []
    parent = c.get_run(run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["traingate.outcome"] == "passed"
    full = [r for r in runs if r.data.tags.get("traingate.stage") == "full"]
    assert len(full) == 1 and full[0].info.status == "FINISHED"
    assert full[0].data.tags["traingate.promotion"].startswith("registered ")
    return p


def _kill_cli_and_check(cli: Cli, stage: str, parent_left: tuple[str, ...] = ("RUNNING",)) -> tuple[str, str]:
    run_dir = cli.run_dir()
    assert run_dir is not None
    run_id = run_dir.name
    flow_run_id = json.loads((run_dir / "orchestrator.json").read_text())["flow_run_id"]
    pids = _heartbeat_pids(run_dir)
    killed_at = time.monotonic()
    cli.proc.send_signal(signal.SIGKILL)
    cli.proc.wait(30)
    while (alive := describe(run_processes(run_id, pids=frozenset(pids)))) and time.monotonic() - killed_at < GRACE_S:
        time.sleep(0.2)
    assert not alive, f"{GRACE_S} s after the CLI was killed, processes of run {run_id} live on: {alive}"
    # The orphaned tree noticed and checkpointed on its way out (unless it was between launches).
    words = [json.loads(f.read_text()) for f in (run_dir / stage).glob("last_words.rank*.json")]
    assert all(w["cause"] == "orchestrator_lost" for w in words), words
    c = _mlflow(cli)
    assert c.get_run(run_id).info.status in parent_left  # nothing closed it: the next orchestrator must
    return run_id, flow_run_id


def test_sigkill_of_the_cli_mid_smoke_canary_and_full_leaves_no_process_and_each_resume_goes_on_to_the_end(
        prefect_api, tiny_spec, tmp_path):
    """One pipeline whose orchestrator is SIGKILLed three times: `traingate run` mid-smoke, then the
    `traingate resume` that took over mid-canary, then the next one mid-full. Run and resume drive the
    same ladder flow under the same guardian, so each kill checks what a kill of `run` in that stage
    would, and a resume that is itself killed must be resumable too."""
    cli = Cli(tmp_path, prefect_api, SLOW)
    command = ("run", str(tiny_spec()), *LONGER)
    killed: list[tuple[str, str]] = []  # (stage, flow run id of the killed orchestrator)
    for stage in ("smoke", "canary", "full"):
        rng = random.Random(f"orchestrator-death-{stage}")
        steps = {"smoke": 9, "canary": 30, "full": 30}[stage]  # smoke's part 1 stops at step 10
        kill_at = rng.randint(2, steps - 4)
        try:
            cli.start(*command)
            _wait(_at_step(cli, stage, kill_at), 300, f"{stage} to reach step {kill_at}", cli)
            # A killed `run` leaves its pipeline run RUNNING. A resume's stale sweep first closed it as KILLED
            # and the resume closes it again only when the ladder ends: a killed resume leaves it as it found
            # it, never FINISHED or FAILED.
            parent_left = ("RUNNING",) if command[0] == "run" else ("RUNNING", "KILLED")
            run_id, flow_run_id = _kill_cli_and_check(cli, stage, parent_left)
        finally:
            cli.cleanup()
        killed.append((stage, flow_run_id))
        command = ("resume", run_id)
    _assert_resumed_to_the_end(cli, run_id)
    client = _mlflow(cli)
    experiment = client.get_run(run_id).info.experiment_id
    for stage, flow_run_id in killed:
        assert _flow_run_state(flow_run_id) == "CRASHED", stage
        stage_run = client.search_runs(
            [experiment], f"tags.`traingate.run_id` = '{run_id}' and tags.`traingate.stage` = '{stage}'")[0]
        assert stage_run.data.tags["orchestrator.crash_cause"].startswith("orchestrator_lost: orchestrator pid "), \
            (stage, stage_run.data.tags)


def test_a_rank_killed_mid_canary_is_a_restart_and_ctrl_c_mid_full_preempts_at_a_checkpoint_printing_the_resume_command(
        prefect_api, tiny_spec, tmp_path):
    """One `traingate run`, two faults: a rank SIGKILLed mid-canary is a restart after which the canary
    passes its gate and the ladder climbs on to full; the user's Ctrl-C mid-full then preempts the stage
    at an emergency checkpoint, cancels the flow run and prints the resume command. (That a resume
    finishes such a run to a registered model is the three-kill test's end.)"""
    rank_kill_at = random.Random("rank-death").randint(3, 20)
    ctrl_c_at = random.Random("ctrl-c").randint(3, 25)
    cli = Cli(tmp_path, prefect_api, SLOW)
    try:
        cli.start("run", str(tiny_spec()), *LONGER)
        beat = _wait(lambda: (d := cli.run_dir()) and _at_step(cli, "canary", rank_kill_at)()
                     and _beat(d / "canary", 1), 300, f"canary to reach step {rank_kill_at}", cli)
        os.kill(beat["pid"], signal.SIGKILL)
        _wait(_at_step(cli, "full", ctrl_c_at), 300, f"full to reach step {ctrl_c_at}", cli)
        run_id = cli.run_dir().name
        cli.proc.send_signal(signal.SIGINT)
        code = cli.proc.wait(120)
    finally:
        cli.cleanup()
    out = cli.output()
    canary = json.loads((cli.run_dir() / "canary" / "supervisor.json").read_text())
    assert canary["attempts"][0]["cause"] == "worker_lost" and canary["attempts"][-1]["cause"] is None, canary
    assert canary["final"]["status"] == "completed", canary["final"]  # and its gate let full start
    assert code == 1, out[-4000:]
    assert f"traingate resume {run_id}" in out, out[-3000:]
    assert "Traceback" not in out, out[-4000:]
    state = json.loads((cli.run_dir() / "full" / "supervisor.json").read_text())
    assert state["final"]["status"] == "preempted"
    from traingate.runtime.checkpoint import Checkpointer

    ckpt = Checkpointer(state["job"]["checkpoint_uri"])
    latest = ckpt.find_latest()
    assert latest is not None and latest >= ctrl_c_at and ckpt.manifest(latest)["emergency"] is True
    flow_run_id = json.loads((cli.run_dir() / "orchestrator.json").read_text())["flow_run_id"]
    assert _flow_run_state(flow_run_id) == "CANCELLED"
    assert not describe(run_processes(run_id, pids=frozenset(_heartbeat_pids(cli.run_dir()))))


def test_the_stale_run_sweep_closes_runs_of_a_dead_orchestrator_and_leaves_a_live_one_alone(tmp_path):
    from traingate.tracking import stale

    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = c.create_experiment("stale", artifact_location=(tmp_path / "art").as_uri())
    dead = subprocess.Popen([PYTHON, "-c", "pass"])
    dead.wait()  # a pid that no process holds now
    pipelines = {}
    for who in ("dead", "live", "unknown"):
        parent = c.create_run(exp, tags={"traingate.kind": "pipeline"}).info.run_id
        c.set_tag(parent, "traingate.run_id", parent)
        child = c.create_run(exp, tags={"traingate.kind": "stage", "traingate.stage": "canary",
                                        "traingate.run_id": parent, "mlflow.parentRunId": parent}).info.run_id
        run_dir = tmp_path / "state" / "runs" / parent
        if who != "unknown":  # a run with no orchestrator.json and no supervisor pid: cannot tell, left alone
            o = stale.claim(run_dir, flow_run_id=f"flow-{who}")
            if who == "dead":
                (run_dir / stale.ORCHESTRATOR).write_text(json.dumps({**o.__dict__, "pid": dead.pid}))
        else:
            run_dir.mkdir(parents=True)
        pipelines[who] = (parent, child)

    closed = stale.sweep(c, tmp_path / "state", flow_run_state=lambda fid: "RUNNING")
    assert sorted((s.kind, s.mlflow_run_id) for s in closed) == sorted(
        [("pipeline", pipelines["dead"][0]), ("stage", pipelines["dead"][1])])
    assert {s.flow_run_id for s in closed} == {"flow-dead"}
    for rid in pipelines["dead"]:
        run = c.get_run(rid)
        assert run.info.status == "KILLED"
        assert run.data.tags[stale.CAUSE_TAG] == f"orchestrator_lost: orchestrator pid {dead.pid} on " \
                                                 f"{stale.socket.gethostname()} is gone"
    for rid in (*pipelines["live"], *pipelines["unknown"]):
        assert c.get_run(rid).info.status == "RUNNING"
    # A live process whose flow run already ended (it crashed in that process) is stale too.
    closed = stale.sweep(c, tmp_path / "state", flow_run_state=lambda fid: "CRASHED" if fid == "flow-live" else None)
    assert {s.mlflow_run_id for s in closed} == set(pipelines["live"])
    assert c.get_run(pipelines["live"][0]).data.tags[stale.CAUSE_TAG] == \
        "orchestrator_lost: its Prefect flow run flow-live is crashed"
    assert c.get_run(pipelines["unknown"][0]).info.status == "RUNNING"
