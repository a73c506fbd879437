"""What a command shows on the terminal and what goes to its log file (flows/cli/console.py)."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flows.cli import console
from tgtest import PYTHON
from traingate.settings import Settings

# What traingate prints after the plan: its status lines, the verdict, the indented summary, blank lines.
TRAINGATE_LINE = re.compile(r"traingate: \S.*|pipeline (PASSED|STOPPED): .+|  \S.*|")


def _from_traingate(source: str, **names) -> None:
    """Run ``source`` as code of traingate's own packages (flows/), as the CLI's modules are."""
    exec(compile(source, str(Path(console.OUR_CODE[0]) / "cli" / "_test_caller.py"), "exec"), dict(names))


@pytest.fixture
def settings(monkeypatch, tmp_path):
    """A state dir that exists; the root logger's handlers (Prefect's console handler) out of the way."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    return Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path / "state")}).ensure()


def _library_noise() -> None:
    logging.getLogger("some.library").warning("library warning record")
    logging.getLogger("prefect.flow_runs").error("Finished in state Failed()")
    warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)
    sys.stderr.write("Downloading artifacts:  50%|#####     | 1/2\rDownloading artifacts: 100%|##########| 2/2\n")
    print("View run at: http://127.0.0.1:5000")
    sys.stdout.writelines(["a library's writelines\n"])


def test_by_default_the_terminal_shows_traingate_lines_and_the_log_file_keeps_the_rest(settings, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with console.session("runs", settings, verbose=False):
            _library_noise()
            _from_traingate("print('traingate: smoke running')\nlogging.getLogger('traingate.x').warning('disk low')"
                            "\nlogging.getLogger('traingate.x').info('launch 1: python -m ...')", logging=logging)
    assert capsys.readouterr() == ("traingate: smoke running\n", "traingate: WARNING disk low\n")
    log = (settings.state_dir / "logs" / "runs.log").read_text()
    for kept in ("library warning record", "Finished in state Failed()", "a library's deprecation",
                 "stderr: Downloading artifacts: 100%", "stdout: View run at", "stdout: a library's writelines", "disk low", "launch 1: python"):
        assert kept in log, kept
    assert "traingate: smoke running" not in log


def test_with_v_the_terminal_shows_what_the_log_file_keeps(settings, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with console.session("runs", settings, verbose=True):
            _library_noise()
    out, shown = capsys.readouterr()
    assert "View run at" in out
    for line in ("library warning record", "Finished in state Failed()", "a library's deprecation",
                 "Downloading artifacts: 100%"):
        assert line in shown, shown
    assert "a library's deprecation" in (settings.state_dir / "logs" / "runs.log").read_text()


def test_the_run_log_holds_what_came_before_the_run_was_known_and_the_session_gives_back_streams(settings, capsys):
    streams = sys.stdout, sys.stderr
    run_dir = settings.state_dir / "runs" / "r1"
    handlers = list(logging.getLogger().handlers)
    with console.session("run", settings, verbose=False):
        logging.getLogger("prefect").warning("Starting temporary server")
        assert console.attach(run_dir) == run_dir / console.RUN_LOG
        logging.getLogger("mlflow").warning("after attach")
        assert os.environ.get(console.PROGRESS_BAR_VAR) == "false"  # the training processes inherit it
    assert (sys.stdout, sys.stderr) == streams and logging.getLogger().handlers == handlers
    text = (run_dir / console.RUN_LOG).read_text()
    assert text.index("Starting temporary server") < text.index("after attach")
    assert not (settings.state_dir / "logs").exists()
    assert capsys.readouterr() == ("", "")


def test_a_command_that_made_no_state_dir_leaves_no_log_behind(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    settings = Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path / "state")})
    with console.session("validate", settings, verbose=False):
        logging.getLogger("some.library").warning("noise")
    assert not settings.state_dir.exists() and capsys.readouterr() == ("", "")


def test_prefects_home_in_a_state_dir_not_made_yet_is_made_when_prefect_is_imported(tmp_path, monkeypatch):
    state = tmp_path / "new" / "state"
    finder = console.PrefectHome(state)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "elsewhere" / "prefect"))
    finder.find_spec("prefect")
    assert not state.exists()  # a home the user chose is the user's
    monkeypatch.setenv("PREFECT_HOME", str(state / "prefect"))
    finder.find_spec("mlflow")
    assert not state.exists()  # only Prefect's import makes it
    assert finder.find_spec("prefect") is None and state.is_dir()


@pytest.mark.slow
def test_run_piped_from_outside_the_checkout_prints_only_traingate_lines(prefect_api, tiny_spec, tmp_path):
    """The demo's ladder up to its unit stage, as a new user runs it from their own directory: no state
    dir, no Prefect home, output to a pipe. Prefect's, MLflow's and pytest's lines land in the run's log."""
    spec = tiny_spec()
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINGATE_STATE_DIR", "PREFECT_HOME")}
    env.update(prefect_api, PREFECT_LOGGING_LEVEL="INFO")
    argv = [str(Path(PYTHON).parent / "traingate"), "run", str(spec), "--until", "unit"]
    plan = subprocess.run([*argv, "--dry-run"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr[-3000:]
    p = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-4000:]
    assert p.stdout.startswith(plan.stdout), p.stdout[-4000:]
    after_plan = p.stdout[len(plan.stdout):].splitlines()
    assert [line for line in after_plan if not TRAINGATE_LINE.fullmatch(line)] == [], p.stdout
    assert "traingate: unit completed: 7/7 tests passed" in after_plan and "pipeline PASSED: unit passed" in after_plan
    assert not [line for line in after_plan if "WARNING" in line or "ERROR" in line], p.stdout  # a healthy run
    state = cwd / ".traingate"
    assert (state / "prefect").is_dir()  # Prefect's home, made without "Failed to create the Prefect home"
    log = next((state / "runs").glob(f"*/{console.RUN_LOG}"))
    assert f"  log (-v shows it here): {log}" in after_plan
    text = log.read_text()
    for library_line in ("Beginning flow run", "Creating initial MLflow database tables", "Finished in state"):
        assert library_line in text, text[-3000:]


def test_a_terminal_is_a_terminal_to_traingate_and_a_log_file_to_a_library(settings, monkeypatch):
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", tty)
    try:
        with console.session("run", settings, verbose=False):
            seen: dict = {}
            _from_traingate("seen['traingate'] = sys.stdout.isatty()", sys=sys, seen=seen)
            seen["library"] = sys.stdout.isatty()  # tqdm, rich and colour handlers ask before drawing
            assert console.terminal_of(sys.stdout) is tty
    finally:
        tty.close()
        os.close(master)
    assert seen == {"traingate": True, "library": False}
