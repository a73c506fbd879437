"""Warm restarts (supervision.warm_restarts): workers forked from a pre-imported zygote, under the real
supervisor, real torchrun (2 ranks, gloo) and the tiny digits stage. The same promises as cold starts:
exact resume, the emergency checkpoint on SIGTERM, and nothing left behind; a dead zygote only makes
starts slow again."""
from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from traingate.job import files
from traingate.job.stagejob import derive
from traingate.job.vocab import Status
from traingate.runtime import inject, warm
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision import guardian
from traingate.supervision.drill import _weights, compare_states, final_state
from traingate.supervision.drivers import start_zygote
from traingate.supervision.supervisor import Hooks, Supervision, supervise

pytestmark = pytest.mark.slow

SPEC = """
stages:
  full: {max_steps: 16}
checkpoint: {every_steps: 5}
tracking: {enabled: false, log_every: 2}
supervision: {backoff_base_s: 0.2, backoff_max_s: 1.0, hang_timeout_s: 8, preempt_grace_s: 20}
"""
WARM = "supervision.warm_restarts=true"


class Run:
    def __init__(self, sup: Supervision, stage_dir: Path, checkpoint_uri: str, log: list[str],
                 before: set[int]):
        self.sup, self.stage_dir, self.checkpoint_uri, self.log = sup, stage_dir, checkpoint_uri, log
        self.before = before  # our children before the stage (a session's Prefect server, say)

    def left_behind(self) -> list[psutil.Process]:
        """Processes under us that the stage started and that are still there."""
        return [p for p in psutil.Process().children(recursive=True)
                if p.pid not in self.before and not guardian.is_guardian(p)]

    @property
    def causes(self) -> list[str | None]:
        return [a.cause for a in self.sup.attempts]

    def forked(self) -> set[int]:
        """Pids of the workers the zygote forked."""
        text = (self.stage_dir / "zygote.log").read_text()
        return {int(p) for p in re.findall(r"zygote: forked worker (\d+)", text)}


@pytest.fixture
def stage(tiny_spec, state_dir, tmp_path) -> Callable[..., Run]:
    """stage("kill@7:1", WARM, hooks=f) -> Run: the tiny full stage (2 ranks, 16 steps) under the supervisor.

    ``hooks``: stage dir -> the supervisor's Hooks (a test that acts on heartbeats needs the directory).
    """
    def run(faults: str = "", *overrides: str, name: str = "run",
            hooks: Callable[[Path], Hooks] | None = None) -> Run:
        spec = load_spec(tiny_spec(SPEC, name=f"{name}.yaml"), list(overrides))
        job = derive(spec, "full", run_id=name, run_dir=tmp_path / name, settings=Settings.from_env(),
                     faults=faults or None)
        log: list[str] = []
        hooks = hooks(Path(job.stage_dir)) if hooks else Hooks()
        hooks.info = log.append
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        sup = supervise(job, hooks=hooks, seed=0)
        return Run(sup, Path(job.stage_dir), job.checkpoint_uri, log, before)
    return run


@pytest.fixture(scope="module")
def _kept() -> dict[str, Run]:
    return {}


@pytest.fixture
def cold_reference(stage, _kept) -> Run:
    """The tiny full stage started cold and never disturbed: the weights both warm recoveries must end with.
    Run once per module, by the first test that asks (its directories stay until the session ends)."""
    if "cold" not in _kept:
        run = stage("", name="cold")
        assert run.sup.status == Status.COMPLETED, run.log
        assert run.left_behind() == []
        _kept["cold"] = run
    return _kept["cold"]


def _zygote() -> psutil.Process | None:
    return next((p for p in psutil.Process().children() if "--serve" in p.cmdline()), None)


def _assert_nothing_left(run: Run) -> None:
    assert run.left_behind() == []
    for pid in run.forked():  # forked workers are the zygote's children, not torchrun's: checked by pid
        if psutil.pid_exists(pid):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"worker {pid} outlived the stage"
    sockets = re.findall(r"zygote: ready on (\S+) ", (run.stage_dir / "zygote.log").read_text())
    assert sockets and not any(os.path.exists(s) for s in sockets)  # its private socket dir is gone too


def test_warm_restart_after_a_killed_rank_ends_with_weights_bitwise_equal_to_an_undisturbed_cold_run(
        stage, cold_reference):
    run = stage("kill@7:1", WARM, name="warm")
    assert run.sup.status == Status.COMPLETED, run.log
    assert run.causes == ["worker_lost", None], run.log
    assert run.sup.attempts[1].inplace  # torchrun restarted the group in place, through the zygote again
    # Every worker of both incarnations was forked (2 ranks x 2), the killed one among them.
    (fired,) = inject.fired(run.stage_dir)
    assert fired["pid"] in run.forked() and len(run.forked()) == 4
    # The restarted workers were forked after the zygote had loaded the recipe data they train on.
    log = (run.stage_dir / "zygote.log").read_text()
    assert log.index("zygote: preloaded the data of") < log.index("torchrun restart 1)")
    assert compare_states(_weights(final_state(cold_reference.checkpoint_uri)),
                          _weights(final_state(run.checkpoint_uri))) == []
    _assert_nothing_left(run)


def _rank0_step(stage_dir: Path) -> int:
    beats = files.read_heartbeats(stage_dir)
    return beats[0].step if 0 in beats else -1


def test_preempting_a_warm_stage_with_sigterm_writes_the_emergency_checkpoint_and_exits_75(stage):
    def hooks(stage_dir: Path) -> Hooks:
        # As a cancelled flow run does: the supervisor SIGTERMs the tree; the entries relay it.
        return Hooks(stop_requested=lambda: "cancelled by the test" if _rank0_step(stage_dir) >= 3 else None)

    run = stage("slow@0", WARM, name="preempt", hooks=hooks)
    assert run.sup.status == Status.PREEMPTED and run.causes == ["preempted"], run.log
    assert "emergency checkpoint written" in run.sup.error
    result = files.read_result(run.stage_dir)  # rank 0's own account of how it ended
    assert result.status == Status.PREEMPTED and result.exit_code == 75
    step = final_state(run.checkpoint_uri)["train_state"]["step"]
    assert step == result.last_checkpoint_step == result.steps_done and 3 <= step < 16
    assert step != 5 or result.steps_done == 5  # the step it stopped at, not only the last periodic save
    assert len(run.forked()) == 2  # the preempted workers were the zygote's
    _assert_nothing_left(run)


def test_a_sigkilled_zygote_leaves_starts_cold_and_the_stage_still_completes(stage, cold_reference):
    killed: list[int] = []

    def hooks(stage_dir: Path) -> Hooks:
        def kill_zygote_once() -> None:
            if not killed and _rank0_step(stage_dir) >= 2 and (z := _zygote()) is not None:
                killed.append(z.pid)
                z.send_signal(signal.SIGKILL)
        return Hooks(on_tick=kill_zygote_once)

    # Paced steps (0.1 s): the zygote is gone a second before rank 1's kill, on a loaded box too, so the
    # restart is the one that finds no zygote.
    run = stage("slow@0,kill@12:1", WARM, name="nozygote", hooks=hooks)
    assert killed, run.log
    assert run.sup.status == Status.COMPLETED and run.causes == ["worker_lost", None], run.log
    assert len(run.forked()) == 2  # the first group only: the restarted one started cold
    assert compare_states(_weights(final_state(cold_reference.checkpoint_uri)),
                          _weights(final_state(run.checkpoint_uri))) == []
    assert run.left_behind() == []
    for pid in run.forked():  # the killed zygote's orphans (reparented away from us) ended too
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_thin_entry_runs_the_worker_itself_when_no_zygote_answers(tmp_path):
    # A socket path nobody listens on: the entry falls back to train.main, which names what is missing.
    env = {k: v for k, v in os.environ.items() if k != "TRAINGATE_JOB"}
    out = subprocess.run([sys.executable, "-m", "traingate.runtime.warm", str(tmp_path / "none.sock")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 64 and "no job; pass --job PATH" in out.stderr


def test_the_thin_entry_imports_neither_torch_nor_traingate_before_it_asks_the_zygote(tmp_path):
    # A listener that records what it was sent and answers "exited 0": what the entry costs, alone.
    path = str(tmp_path / "z.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    probe = ("import sys, runpy; sys.argv = ['warm', %r, '--job', 'x'];"
             "rc = None\n"
             "try:\n    runpy.run_module('traingate.runtime.warm', run_name='__main__')\n"
             "except SystemExit as e:\n    rc = e.code\n"
             "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'traingate', 'pydantic')))") % path
    t0 = time.monotonic()
    entry = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
    conn, _ = server.accept()
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    assert len(fds) == 3 and b'"argv": ["--job", "x"]' in data
    for fd in fds:
        os.close(fd)
    conn.sendall(b"P" + entry.pid.to_bytes(4, "big") + b"X" + (0).to_bytes(4, "big"))
    out, _ = entry.communicate(timeout=30)
    elapsed = time.monotonic() - t0
    assert out.strip() == "0 ['traingate', 'traingate.runtime', 'traingate.runtime.handoff']"
    assert elapsed < 2.0  # generous for a loaded box; the entry itself is ~30 ms of interpreter start


def test_a_zygote_that_finds_threads_after_its_imports_refuses_to_serve_and_says_why(tmp_path):
    # Forking a process with a thread pool copies its locks held; OpenBLAS starts one at import here.
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}
    zygote = warm.Zygote(sys.executable, env, str(tmp_path / "zygote.log"))
    zygote.popen.wait(timeout=60)
    why = zygote.stop()
    assert why is not None and "ended early with status 3" in why and "threads after the imports" in why
    assert not os.path.exists(zygote.dir)


def test_a_zygote_whose_supervisor_died_before_it_started_exits_instead_of_serving_nobody(tmp_path):
    # A supervisor SIGKILLed right after starting its zygote (a killed CLI): the zygote's first look finds
    # another parent, before the guardian of the dead supervisor ever saw it.
    # The zygote's interpreter starts once its supervisor is gone (a wrapper waits for that, then execs it): on a
    # busy machine the supervisor may otherwise still be alive, descheduled, at the zygote's first look.
    log = tmp_path / "zygote.log"
    late = tmp_path / "python-once-the-parent-is-gone"
    late.write_text("#!/bin/sh\n"  # its parent pid (/proc/PID/stat's 4th field) changes as the supervisor exits
                    'while [ "$(cut -d" " -f4 /proc/$$/stat)" = "$TG_SUPERVISOR" ]; do sleep 0.01; done\n'
                    f'exec {sys.executable} "$@"\n')
    late.chmod(0o755)
    code = ("import os, sys\nfrom traingate.runtime import warm\n"
            f"z = warm.Zygote({str(late)!r}, dict(os.environ, TG_SUPERVISOR=str(os.getpid())), {str(log)!r})\n"
            "print(z.pid, z.dir, flush=True)\nos._exit(0)\n")
    pid, directory = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                                    check=True).stdout.split()
    zygote = psutil.Process(int(pid))
    try:
        end = time.monotonic() + 60
        while zygote.is_running() and zygote.status() != psutil.STATUS_ZOMBIE and time.monotonic() < end:
            time.sleep(0.1)
        assert not zygote.is_running() or zygote.status() == psutil.STATUS_ZOMBIE, "the orphaned zygote serves on"
        assert "ended before it started; not serving" in log.read_text()
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            zygote.kill()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_zygote_started_ahead_of_its_stage_forks_that_stages_workers_and_ends_with_it(tiny_spec, state_dir,
                                                                                         tmp_path):
    # The ladder starts the smoke stage's zygote beside the unit stage; the stage's supervision takes it over.
    spec = load_spec(tiny_spec(SPEC, name="ahead.yaml"), [WARM])
    job = derive(spec, "full", run_id="ahead", run_dir=tmp_path / "ahead", settings=Settings.from_env())
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    zygote = start_zygote(job)
    assert zygote is not None
    log: list[str] = []
    sup = supervise(job, hooks=Hooks(info=log.append), seed=0, zygote=zygote)
    run = Run(sup, Path(job.stage_dir), job.checkpoint_uri, log, before)
    assert sup.status == Status.COMPLETED, log
    text = (run.stage_dir / "zygote.log").read_text()
    assert text.count("zygote: ready on") == 1  # the one started ahead served the stage; none was started again
    assert len(run.forked()) == 2
    _assert_nothing_left(run)


def test_a_zygote_started_ahead_and_never_taken_over_is_stopped_when_dropped(tiny_spec, state_dir, tmp_path):
    spec = load_spec(tiny_spec(SPEC, name="dropped.yaml"), [WARM])
    job = derive(spec, "full", run_id="dropped", run_dir=tmp_path / "dropped", settings=Settings.from_env())
    zygote = start_zygote(job)
    assert zygote is not None
    popen, directory = zygote.popen, zygote.dir
    del zygote
    gc.collect()
    assert popen.poll() is not None and not os.path.exists(directory)
