"""Ctrl-C of `traingate run` in a terminal: the whole foreground process group gets SIGINT.

Real everything: the CLI subprocess (its own session, as a shell's job is its own process group)
with its temporary Prefect server, MLflow on SQLite, a torchrun tree."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time

import pytest

from tgtest import PYTHON, ROOT

pytestmark = pytest.mark.slow


def test_a_terminal_ctrl_c_mid_stage_prints_the_resume_command_and_the_resume_counts_one_restart(
        tiny_spec, tmp_path, prefect_api, monkeypatch, capsys):
    """The run on its own temporary server (its shield against the terminal's SIGINT is the subject); the
    resume on the session's server (`prefect_api`), as a resume from another machine would be."""
    env = {**os.environ, "TRAINGATE_STATE_DIR": str(tmp_path / "state"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PYTHONUNBUFFERED": "1", "TRAINGATE_INJECT": "slow@0:0"}
    out = tmp_path / "run.out"
    cli = subprocess.Popen([PYTHON, "-m", "flows.cli", "run", str(tiny_spec()), "--until", "smoke",
                            "--set", "stages.smoke.max_steps=40"], cwd=ROOT, env=env, stdout=open(out, "w"),
                           stderr=subprocess.STDOUT, start_new_session=True)
    runs = tmp_path / "state" / "runs"
    try:
        deadline = time.monotonic() + 300
        while not list(runs.glob("*/smoke/heartbeat.rank0.json")):
            assert cli.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.1)
        os.killpg(cli.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the CLI and every child in its group
        code = cli.wait(180)
    finally:
        if cli.poll() is None:
            cli.kill()
        try:
            os.killpg(cli.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = out.read_text()
    run_id = next(runs.glob("*")).name
    assert code == 1, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert f"pipeline STOPPED: smoke preempted at a checkpoint; continue with: traingate resume {run_id}" in text
    flow_run_id = json.loads((runs / run_id / "orchestrator.json").read_text())["flow_run_id"]
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        state_type, message = db.execute(
            "SELECT flow_run.state_type, flow_run_state.message FROM flow_run JOIN flow_run_state "
            "ON flow_run.state_id = flow_run_state.id WHERE flow_run.id = ?", (flow_run_id,)).fetchone()
    assert state_type == "CANCELLED" and f"traingate resume {run_id}" in message

    # The resume and `traingate show` in this process (their own process is not the subject here): each
    # `traingate` subprocess would pay its interpreter and imports again.
    from flows.cli import main

    monkeypatch.setenv("TRAINGATE_STATE_DIR", env["TRAINGATE_STATE_DIR"])
    capsys.readouterr()
    code = main(["resume", run_id, "--until", "smoke"])
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    assert "resume PASSED" in out
    # the resume summary and `traingate show` count the same restarts: the preemption, once
    smoke_line = next(line for line in out.splitlines() if line.strip().startswith("smoke "))
    assert "restarts 1 " in smoke_line, out
    code = main(["show", run_id])
    shown, err = capsys.readouterr()
    assert code == 0, err
    restarts = [line.strip() for line in shown.splitlines() if line.strip().startswith("restart ")]
    assert len(restarts) == 1 and restarts[0].startswith("restart 1: cause preempted"), shown
