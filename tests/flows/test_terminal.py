"""What `traingate run` shows while it runs: a progress bar with ETA in a terminal, one line per stage
transition elsewhere (flows/cli/terminal.py)."""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tgtest import PYTHON, ROOT
from traingate.job import files
from traingate.settings import Settings

sys.path.insert(0, str(ROOT / "tests" / "monitor"))
from test_watch import ANSI, Terminal  # noqa: E402 - the pseudo-terminal driver of the watch tests


@pytest.mark.slow
def test_run_in_a_terminal_draws_a_progress_bar_with_eta_and_keeps_raw_process_lines_off_it(prefect_api, tiny_spec,
                                                                                             tmp_path):
    env = {**os.environ, "TRAINGATE_STATE_DIR": str(tmp_path / "state"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "TRAINGATE_INJECT": "slow@0", "PREFECT_LOGGING_LEVEL": "INFO", **prefect_api}
    term = Terminal([PYTHON, "-m", "flows.cli", "run", "-v", str(tiny_spec()), "--until", "smoke",
                     "--set", "stages.smoke.max_steps=60", "--set", "resources.procs_per_node=1"], env)
    try:
        assert term.wait(400) == 0, term.text[-4000:]
    finally:
        term.kill()
    text = term.text
    assert "pipeline PASSED" in text, text[-4000:]
    bars = re.findall(r"smoke +[█░]{10,40} (\d+)/60 +\d+%  ETA \d+:\d\d  loss [\d.e+-]+  \$\d+\.\d{4}", text)
    assert len(set(bars)) >= 3, text[-4000:]  # drawn again as the stage advanced
    assert "traingate: smoke running: 60 steps on 1 process (cpu-local)" in text, text[-4000:]
    assert re.search(r"traingate: smoke completed at step 60/60 in \d+:\d\d, run \$\d+\.\d{4} so far", text)
    # The training processes' own lines (the runtime's start line, torchrun's) stay in stdout.log and Prefect...
    stdout_log = next((tmp_path / "state" / "runs").glob("*/smoke/stdout.log")).read_text()
    assert "[rank 0] stage smoke: world 1" in stdout_log
    # ...not on the terminal; with -v the supervisor's and Prefect's lines are, above the bar.
    assert "[rank 0]" not in text, text[-4000:]
    assert "smoke: supervised: hang timeout" in text and "Finished in state Completed" in text
    assert "Traceback" not in text


def test_log_records_print_above_the_bar_and_process_output_lines_are_dropped_in_a_terminal(tmp_path):
    from flows.cli.terminal import PROCESS_OUTPUT_THREAD, follow_run

    master, slave = os.openpty()
    out = os.fdopen(slave, "w", buffering=1)
    logger = logging.getLogger("traingate-test-terminal")
    logger.propagate = False
    console = logging.StreamHandler(out)
    logger.addHandler(console)
    logger.setLevel(logging.INFO)
    try:
        with follow_run(Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path / "state")}), out=out) as follower:
            assert console not in logger.handlers  # stood in for while the bar is drawn
            time.sleep(0.8)  # the bar is drawn (still waiting for a run)
            logger.info("a supervisor line")
            pump = threading.Thread(target=logger.info, args=("a raw process line",), name=PROCESS_OUTPUT_THREAD)
            pump.start()
            pump.join()
            logger.warning("a warning")
            assert follower.tty
        assert logger.handlers == [console]  # given back
        os.set_blocking(master, False)
        raw = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            raw += chunk
    finally:
        logger.removeHandler(console)
        out.close()
        os.close(master)
    text = raw.decode()
    assert "a raw process line" not in text
    # each record: the bar erased first, the record on a line of its own, the bar drawn again below it
    assert re.search(r"starting the run \(0:0\d\)\x1b\[K\r\x1b\[Ka supervisor line\r?\n\rstarting the run", text), text
    assert "\r\x1b[Ka warning\r\n" in text
    assert text.endswith("\r\x1b[K"), text[-200:]  # the bar is gone when the run's summary is printed


def _stage(run_dir: Path, name: str, status: str | None, attempts: int, mtime: float, step: int = 0) -> None:
    d = run_dir / name
    d.mkdir(parents=True, exist_ok=True)
    files.write_json(d / files.JOB, {"stage": name, "max_steps": 10, "nodes": 1, "procs_per_node": 2,
                                     "pool": "cpu-local", "slots": 2, "price_per_slot_hour": 0.0,
                                     "launched_at": mtime})
    # The supervisor records an attempt when it ends: a running stage's last launch is not in the list.
    causes = ["worker_lost"] * (attempts - 1) + ([None] if status == "completed" else [])
    runs = [{"number": i, "launched_at": mtime, "ended_at": mtime, "cause": c, "end_step": step}
            for i, c in enumerate(causes)]
    final = {"status": status} if status else None
    files.write_supervisor_state(d, files.SupervisorState(attempts=runs, final=final))
    os.utime(d / files.SUPERVISOR, (mtime, mtime))


def test_without_a_terminal_each_stage_transition_is_one_line_and_a_resume_does_not_repeat_finished_stages(tmp_path):
    from flows.cli.terminal import Transitions

    run_dir = tmp_path / "r1"
    start = time.time()
    (run_dir / "unit").mkdir(parents=True)
    (run_dir / "unit" / "junit.xml").write_text('<testsuite tests="3" failures="0" errors="0"/>')
    os.utime(run_dir / "unit" / "junit.xml", (start - 100, start - 100))
    _stage(run_dir, "smoke", "completed", 1, start - 90, step=10)   # finished before this resume began
    _stage(run_dir, "canary", None, 1, start + 1)
    t = Transitions(run_dir, started=start)
    assert t.poll(start + 2)[1] == ["traingate: canary running: 10 steps on 2 processes (cpu-local)"]
    assert t.poll(start + 3)[1] == []  # nothing changed: nothing printed
    _stage(run_dir, "canary", None, 2, start + 4)  # a worker was lost: relaunched
    assert t.poll(start + 5)[1] == ["traingate: canary relaunched (launch 2): the last one ended with worker_lost"]
    _stage(run_dir, "canary", "completed", 2, start + 6, step=10)
    assert t.poll(start + 7)[1] == ["traingate: canary completed at step 10/10 in 0:05, run $0.0000 so far"]
    shutil.rmtree(run_dir / "canary")
    _stage(run_dir, "full", "failed", 1, start + 8, step=3)
    files.write_supervisor_state(run_dir / "full", files.SupervisorState(
        attempts=[{"number": 0, "launched_at": start + 8, "ended_at": start + 9, "cause": "user_error", "end_step": 3}],
        final={"status": "failed", "error": "user_error: bad recipe code\nTraceback ..."}))
    assert t.poll(start + 10)[1] == ["traingate: full failed at step 3/10, run $0.0000 so far: user_error: bad recipe code"]


def test_the_bar_line_fits_the_terminal_and_says_eta_loss_and_dollars():
    from flows.cli.terminal import bar_line
    from traingate.monitor.dashboard import Snapshot

    snap = Snapshot("r1", 0.0, (), "canary", "running", 31, 60, 11.0, loss=(2.248,), spent_usd=0.0001)
    for width in (60, 80, 200):
        line = bar_line(snap, width, 0.0)
        assert len(line) <= width - 1
        assert line.endswith(" 31/60  52%  ETA 0:11  loss 2.248  $0.0001"), line
    assert bar_line(snap, 80, 0.0).startswith("canary " + "█" * 16 + "░" * 14 + " ")  # 31/60 of 30 columns
    assert bar_line(None, 80, 75.0) == "starting the run (1:15)"


def test_a_launch_that_ended_as_planned_before_the_stage_verdict_is_not_announced_as_a_relaunch(tmp_path):
    from flows.cli.terminal import Transitions

    run_dir = tmp_path / "r1"
    start = time.time()
    _stage(run_dir, "smoke", None, 1, start + 1)
    t = Transitions(run_dir, started=start)
    assert t.poll(start + 2)[1] == ["traingate: smoke running: 10 steps on 2 processes (cpu-local)"]
    # Its one launch ended without a cause (completed, or smoke's planned stop); the verdict is not written yet.
    ended = [{"number": 0, "launched_at": start + 1, "ended_at": start + 3, "cause": None, "end_step": 5}]
    files.write_supervisor_state(run_dir / "smoke", files.SupervisorState(attempts=ended, final=None))
    assert t.poll(start + 4)[1] == []


def test_a_running_stage_whose_step_total_is_not_known_yet_is_announced_without_a_count(tmp_path):
    from flows.cli.terminal import Transitions

    run_dir = tmp_path / "r1"
    start = time.time()
    _stage(run_dir, "canary", None, 1, start + 1)
    job = files.read_json(run_dir / "canary" / files.JOB)
    files.write_json(run_dir / "canary" / files.JOB, {**job, "max_steps": None})  # a script's total comes later
    t = Transitions(run_dir, started=start)
    assert t.poll(start + 2)[1] == ["traingate: canary running: 2 processes (cpu-local)"]


def test_a_stage_whose_supervisor_started_before_its_first_launch_is_announced_once_the_launch_is_written(tmp_path):
    from flows.cli.terminal import Transitions

    run_dir = tmp_path / "r1"
    start = time.time()
    _stage(run_dir, "smoke", None, 1, start + 1)
    job = files.read_json(run_dir / "smoke" / files.JOB)
    (run_dir / "smoke" / files.JOB).unlink()  # supervisor.json is written as the supervisor starts, job.json at launch
    t = Transitions(run_dir, started=start)
    assert t.poll(start + 2)[1] == []
    files.write_json(run_dir / "smoke" / files.JOB, job)
    assert t.poll(start + 3)[1] == ["traingate: smoke running: 10 steps on 2 processes (cpu-local)"]
