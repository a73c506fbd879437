"""A SIGTERM preemption of the training group (its agent and every worker; the supervisor lives on) is
restarted in place by torchrun from the emergency checkpoint, as a lost worker is; a stop the supervisor
marked, or a SIGTERM after the supervisor is gone, still shuts the group down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from traingate.job import envvars, files
from traingate.runtime import agent


@pytest.mark.slow  # two real 2-rank torchrun incarnations: 15-50 s on the shared 2-core box
def test_a_preempted_group_restarts_in_place_from_its_emergency_checkpoint_under_the_same_supervisor(supervised):
    run = supervised("term@7")  # SIGTERM to torchrun's agent and both workers before step 8
    assert run.sup.status == "completed", run.sup.error
    first, second = run.sup.attempts
    assert (first.cause, second.cause) == ("preempted", None), [(a.cause, a.detail) for a in run.sup.attempts]
    assert second.inplace and first.backoff_s == 0.0  # no new agent, no backoff
    # The SIGTERM arrived during step 8; the emergency checkpoint after it keeps every step.
    assert first.end_step == 8 and second.start_steps == {0: 8, 1: 8}
    (event,) = run.events
    assert event["cause"] == "preempted" and event["inplace"] and event["steps_lost"] == 0
    assert "traingate agent: SIGTERM: the group is preempted" in (run.stage_dir / files.STDOUT).read_text()


def test_the_agent_restarts_in_place_only_for_a_sigterm_its_living_supervisor_did_not_send_outside_slurm(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(envvars.STAGE_DIR, str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv(envvars.SUPERVISOR_PID, raising=False)
    assert agent.stop_reason() == "no supervisor named"
    monkeypatch.setenv(envvars.SUPERVISOR_PID, str(os.getpid()))
    assert agent.stop_reason() is None  # a preemption: restart in place
    files.write_stop(tmp_path, "stopped by its supervisor")
    assert agent.stop_reason() == "the supervisor stops the launch: stopped by its supervisor"
    files.clear_launch_files(tmp_path)  # the next launch starts unmarked
    assert agent.stop_reason() is None
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # Slurm's SIGTERM ends the allocation: no restart in it
    assert agent.stop_reason() == "Slurm job 4242 is being stopped"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setattr(agent, "_nodes", ["2"])  # a group on several nodes is relaunched, never restarted in place
    assert agent.stop_reason() == "the group spans 2 nodes"
    monkeypatch.setattr(agent, "_nodes", ["1"])
    assert agent.stop_reason() is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setenv(envvars.SUPERVISOR_PID, str(gone.pid))
    assert agent.stop_reason() == f"supervisor (pid {gone.pid}) is gone"


def test_an_agent_that_stops_its_group_on_sigterm_leaves_with_one_line_and_no_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (envvars.SUPERVISOR_PID, "SLURM_JOB_ID")}
    env["TMPDIR"] = str(tmp_path)
    agent_proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "traingate.runtime.agent",
            "--standalone",
            "--nproc_per_node=1",
            "--no-python",
            "sh",
            "-c",
            f"touch {tmp_path}/started; exec sleep 60",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists():
            assert agent_proc.poll() is None and time.monotonic() < deadline, agent_proc.stderr.read()
            time.sleep(0.1)
        agent_proc.send_signal(signal.SIGTERM)
        _, err = agent_proc.communicate(timeout=60)
    finally:
        agent_proc.kill()
    assert agent_proc.returncode == 1, err
    assert f"traingate agent: Process {agent_proc.pid} got signal: 15: the group is stopped" in err
    assert "Traceback" not in err
