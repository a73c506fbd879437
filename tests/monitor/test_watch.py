"""`traingate watch RUN_ID`: the live view, read off a pseudo-terminal against a real running run,
and its drawing of a snapshot built from recorded stage files."""
from __future__ import annotations

import io
import json
import math
import os
import pty
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tgtest import PYTHON, ROOT
from traingate.job import files
from traingate.monitor import dashboard

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


class Terminal:
    """A command on a pseudo-terminal of 80x24 (its controlling terminal: Ctrl-C is a keystroke)."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        import fcntl
        import struct
        import termios

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: size the terminal before rich asks for it
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            # As a shell starts a foreground job: Ctrl-C's SIGINT at its default (a test runner started in
            # the background of a script ignores it, and exec would hand that on).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            os.chdir(ROOT)
            os.execve(argv[0], argv, env)
        self.raw = b""
        self.code: int | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # the child closed its side
                break
            if not data:
                break
            self.raw += data

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace"))

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := re.compile(pattern).search(self.text, after):
                return m
            assert self.poll() is None, f"exited {self.code} before {pattern!r}:\n{self.text[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.text[-3000:]}")

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def poll(self) -> int | None:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            assert time.monotonic() < deadline, f"still running after {timeout} s:\n{self.text[-3000:]}"
            time.sleep(0.1)
        self.reader.join(5)
        return self.code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, 9)
            self.wait(10)


# ---------------------------------------------------------------- a real run, watched

SMOKE_STEPS = 160


@pytest.fixture(scope="module")
def live_run(prefect_api, tmp_path_factory):
    """`traingate run --until smoke` (stdout a file, as in CI), each step slowed by 0.1 s so the
    smoke stage lives ~20 s; yields once its first metrics are written."""
    import yaml

    from tgtest import TINY_DIGITS

    tmp = tmp_path_factory.mktemp("watched")
    spec = tmp / "spec.yaml"
    tree = yaml.safe_load(TINY_DIGITS)
    tree["stages"]["smoke"]["max_steps"] = SMOKE_STEPS
    tree["resources"]["procs_per_node"] = 1
    spec.write_text(yaml.safe_dump(tree))
    env = {**os.environ, "TRAINGATE_STATE_DIR": str(tmp / "state"), "PREFECT_HOME": str(tmp / "prefect"),
           "PYTHONUNBUFFERED": "1", "TRAINGATE_INJECT": "slow@0", **prefect_api}
    out = tmp / "run.out"
    cli = subprocess.Popen([PYTHON, "-m", "flows.cli", "run", str(spec), "--until", "smoke"], cwd=ROOT, env=env,
                           stdout=open(out, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    runs = tmp / "state" / "runs"
    deadline = time.monotonic() + 300
    while len(files.read_metrics(next(runs.glob("*/smoke"), tmp / "none"))) < 3:
        assert cli.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.2)
    run_id = next(runs.glob("*/smoke")).parent.name
    yield {"cli": cli, "run_id": run_id, "env": {k: v for k, v in env.items() if k != "TRAINGATE_INJECT"},
           "out": out, "run_dir": runs / run_id}
    if cli.poll() is None:
        cli.kill()
    cli.wait(60)


def _watch(live_run, *extra: str) -> Terminal:
    return Terminal([PYTHON, "-m", "flows.cli", "watch", live_run["run_id"], "--interval", "0.3", *extra],
                    live_run["env"])


@pytest.mark.slow
def test_watch_shows_stage_moving_progress_loss_sparkline_and_dollars_and_ctrl_c_exits_0(live_run):
    assert live_run["cli"].poll() is None, "the run ended before it could be watched"
    term = _watch(live_run)
    try:
        first = term.wait_for(r"smoke\s+[█░]{10,}\s+(\d+)/%d\s+\d+%%\s+ETA \d+:\d\d" % SMOKE_STEPS, 60)
        later = term.wait_for(r"smoke\s+[█░]{10,}\s+(\d+)/%d" % SMOKE_STEPS, 30, after=first.end())
        while int(later.group(1)) == int(first.group(1)):  # the bar moves as the run trains
            later = term.wait_for(r"smoke\s+[█░]{10,}\s+(\d+)/%d" % SMOKE_STEPS, 30, after=later.end())
        screen = term.text[first.start():]
        assert re.search(r"loss\s+[▁▂▃▄▅▆▇█]{5,} \d", screen), screen
        assert re.search(r"cost\s+\$\d+\.\d{4} so far, \$\d+\.\d{4} at the end of smoke", screen), screen
        assert re.search(r"stages\s+unit completed\s+smoke running", screen), screen
        assert "r0 step" in screen and "restarts 0" in screen
        assert all(len(line) <= 80 for line in screen.splitlines()), screen
        term.send(b"\x03")  # Ctrl-C, typed
        assert term.wait(30) == 0, term.text[-2000:]
    finally:
        term.kill()
    assert "Traceback" not in term.text and "KeyboardInterrupt" not in term.text, term.text[-2000:]
    assert f"traingate watch: stopped watching; run {live_run['run_id']}: unit completed, smoke running" in term.text
    assert live_run["cli"].poll() is None, "Ctrl-C of the watcher reached the run"


@pytest.mark.slow
def test_watch_exits_by_itself_with_a_summary_when_the_run_ends(live_run):
    assert live_run["cli"].poll() is None, "the run ended before it could be watched"
    term = _watch(live_run)
    try:
        assert term.wait(300) == 0, term.text[-3000:]
    finally:
        term.kill()
    assert live_run["cli"].wait(30) == 0, live_run["out"].read_text()[-3000:]
    summary = [line for line in term.text.splitlines() if line.startswith("traingate watch: run over")]
    assert len(summary) == 1, term.text[-3000:]
    assert re.fullmatch(r"traingate watch: run over \(orchestrator pid \d+ on .+ is gone\); run %s: unit completed, "
                        r"smoke completed %d/%d, \$\d+\.\d{4} spent" % (live_run["run_id"], SMOKE_STEPS, SMOKE_STEPS),
                        summary[0].strip()), summary[0]
    assert "Traceback" not in term.text
    # Its own stdout was a file (CI): one line per stage transition, and no progress bar.
    out = live_run["out"].read_text()
    transitions = [line for line in out.splitlines() if line.startswith("traingate: ")]
    assert transitions[:2] == ["traingate: unit running: running the recipe's tests",
                               "traingate: unit completed: 7/7 tests passed"] or \
        transitions[0] == "traingate: unit completed: 7/7 tests passed", out[-4000:]
    smoke = [t for t in transitions if t.startswith("traingate: smoke")]
    assert smoke[0] == f"traingate: smoke running: {SMOKE_STEPS} steps on 1 process (cpu-local)", transitions
    assert re.fullmatch(r"traingate: smoke completed at step %d/%d in \d+:\d\d, run \$\d+\.\d{4} so far"
                        % (SMOKE_STEPS, SMOKE_STEPS), smoke[-1]), transitions
    assert not re.search(r"smoke +[█░]{10,}", out) and "ETA" not in out


def test_watch_of_an_unknown_run_names_it_and_the_fix_and_exits_2(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(tmp_path / "state"))
    code = main(["watch", "no-such-run"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip() == (f"traingate watch: no run 'no-such-run' under {tmp_path / 'state' / 'runs'}; list runs "
                           "with `traingate runs` (and use the same TRAINGATE_STATE_DIR)")


# ---------------------------------------------------------------- a snapshot from recorded files

T0 = 1_800_000_000.0


def _recorded_run(run_dir: Path) -> None:
    """A full stage of 2 ranks, 2 slots at $3.60/slot-hour, 60 of 100 steps done at T0 + 300: a worker was
    lost (restart), a loss spike was rolled back (a second restart), a NaN loss line is in the history."""
    stage = run_dir / "full"
    stage.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text("identity: {experiment: vision-big}\n")
    (run_dir / "unit").mkdir()
    (run_dir / "unit" / "junit.xml").write_text('<testsuites><testsuite tests="7" failures="0" errors="0"/></testsuites>')
    files.write_json(stage / files.JOB, {"stage": "full", "max_steps": 100, "nodes": 1, "procs_per_node": 2,
                                         "pool": "gpu-a100", "slots": 2, "price_per_slot_hour": 3.6,
                                         "launched_at": T0 + 200,  # the launch running now
                                         "spec": {"optim": {"batch_size": 16, "grad_accum": 1}}})
    attempts = [{"number": 0, "launched_at": T0, "ended_at": T0 + 100, "cause": "worker_lost", "backoff_s": 5.0,
                 "end_step": 30},
                {"number": 1, "launched_at": T0 + 105, "ended_at": T0 + 200, "cause": "rollback", "backoff_s": 0.0,
                 "end_step": 45}]  # the supervisor records an attempt when it ends: the running one is job.json's launch
    files.write_supervisor_state(stage, files.SupervisorState(job={"stage": "full"}, attempts=attempts))
    w = files.MetricsWriter(stage)
    for step in range(1, 61):  # two steps a second in the last attempt
        loss = math.nan if step == 12 else 2.0 / step
        w.write(files.StepMetrics(step=step, time=T0 + 270 + step * 0.5, loss=loss, grad_norm=1.0, lr=0.1,
                                  step_time_s=0.45, data_wait_s=0.05, attempt=2))
    w.close()
    for rank, t in ((0, 0.45), (1, 0.61)):
        files.write_heartbeat(stage, files.Heartbeat(rank=rank, step=60, time=T0 + 299, pid=100 + rank,
                                                     step_time_s=t, data_wait_s=0.05))
    files.append_alert(stage, files.AlertRecord(time=T0 + 150, stage="full", rule="loss_spike", severity="critical",
                                                action="rollback", at=44, message="loss spike; runbook #loss-spike",
                                                attempt=1, outcome="rolled back to step 40"))
    files.append_alert(stage, files.AlertRecord(time=T0 + 290, stage="full", rule="straggler", severity="warning",
                                                action="notify", at=T0 + 290, message="rank 1 slow; runbook #straggler",
                                                attempt=2, outcome="notified"))


def test_a_snapshot_of_recorded_files_shows_progress_alerts_restarts_and_dollars(tmp_path):
    from rich.console import Console

    run_dir = tmp_path / "runs" / "r-recorded"
    _recorded_run(run_dir)
    snap = dashboard.read_snapshot(run_dir, now=T0 + 300)
    assert (snap.stage, snap.status, snap.step, snap.max_steps) == ("full", "running", 60, 100)
    assert snap.steps_per_s == pytest.approx(2.0) and snap.eta_s == pytest.approx(20.0)
    assert snap.samples_per_s == pytest.approx(64.0)  # 16 per rank x 2 ranks x 2 steps/s
    assert (snap.restarts, snap.rollbacks) == (2, 1)
    # held: 100 s + 5 s backoff, 95 s, and 100 s of the running attempt = 300 s x 2 slots x $3.60/h
    assert snap.spent_usd == pytest.approx(0.60)
    assert snap.projected_usd == pytest.approx(0.64)  # + 20 s to go at $0.002/s
    assert snap.gpu_util_percent is None  # a CPU run: no GPU row at all

    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    console.print(dashboard.render(snap))
    screen = console.export_text()
    lines = screen.splitlines()
    assert all(len(line) <= 80 for line in lines), screen
    assert lines[0].startswith("traingate watch r-recorded  vision-big")
    assert re.search(r"stages\s+unit completed\s+full running", screen)
    assert re.search(r"full\s+█{18}░{12} 60/100  60%  ETA 0:20", screen), screen
    loss = re.search(r"loss\s+(\S+) 0\.03333", screen)
    assert loss and "×" in loss.group(1) and len(loss.group(1)) == 40, screen
    assert re.search(r"speed\s+\S{40} 64 samples/s", screen), screen
    assert "r0 step 60: 450 ms (data 50 ms)" in screen and "r1 step 60: 610 ms (data 50 ms)" in screen
    assert "critical loss_spike at step 44, 2:30 ago: rolled back to step 40" in screen
    assert f"warning straggler at {time.strftime('%H:%M:%S', time.localtime(T0 + 290))}, 0:10 ago: notified" in screen
    assert re.search(r"restarts\s+2 \(of which 1 roll-back\)", screen)
    assert re.search(r"cost\s+\$0\.6000 so far, \$0\.6400 at the end of full *\n", screen), screen
    assert re.search(r"pool\s+gpu-a100: 2 slots x \$3\.6/slot-hour", screen), screen
    assert "gpu" not in [line.split()[0] for line in lines if line.strip()]
    assert dashboard.summary_line(snap) == "run r-recorded: unit completed, full running 60/100, 2 restarts, $0.6000 spent"


def test_a_gpu_run_shows_utilisation_and_a_run_without_stages_draws_without_error(tmp_path):
    from rich.console import Console

    run_dir = tmp_path / "runs" / "r-gpu"
    _recorded_run(run_dir)
    with open(run_dir / "full" / files.METRICS, "a") as f:
        f.write(json.dumps({"step": 61, "time": T0 + 301, "loss": 0.03, "grad_norm": 1.0, "lr": 0.1,
                            "step_time_s": 0.4, "data_wait_s": 0.0, "attempt": 2, "gpu_util_percent": 87.0}) + "\n")
    snap = dashboard.read_snapshot(run_dir, now=T0 + 302)
    assert snap.gpu_util_percent == 87.0
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    console.print(dashboard.render(snap))
    assert re.search(r"gpu\s+87% utilised \(rank 0\)", console.export_text())

    empty = tmp_path / "runs" / "r-new"
    empty.mkdir(parents=True)
    snap = dashboard.read_snapshot(empty, now=T0)
    console.print(dashboard.render(snap))
    assert "none started yet" in console.export_text()
    assert dashboard.summary_line(snap) == "run r-new: no stage started, $0.0000 spent"


def test_watch_help_imports_neither_rich_nor_the_heavy_libraries():
    probe = ("import json, sys\nfrom flows.cli import main\ntry:\n    main(['watch', '--help'])\nexcept SystemExit:\n"
             "    pass\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
             "{'rich', 'prefect', 'mlflow', 'torch', 'optuna'})), file=sys.stderr)\n")
    p = subprocess.run([PYTHON, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stderr.strip().splitlines()[-1]) == [], p.stderr
    assert "--interval S" in p.stdout and "--once" in p.stdout
