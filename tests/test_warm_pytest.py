"""The unit stage's warm pytest interpreter: started before its arguments exist, it runs them as
`python -m pytest` would in the handed directory and environment."""

from __future__ import annotations

import os
import re
import subprocess
import time

from tgtest import PYTHON, ROOT

from traingate.launch.pytest_child import CONTRACT_PRELOAD
from traingate.launch.warm_pytest import WarmPytest


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **extra}


def _project(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "helper.py").write_text("VALUE = 3\n")  # importable from the working directory, as with -m pytest
    (project / "test_it.py").write_text(
        "import os\nimport helper\n\n"
        "def test_environment_and_directory():\n"
        "    assert os.environ['TG_WARM_SEEN'] == 'late'\n"
        f"    assert os.getcwd() == {str(project)!r}\n"
        "    assert helper.VALUE == 3\n\n"
        "def test_asserts_are_rewritten():\n"
        "    values = [1, 2]\n"
        "    assert values == [1, 3]\n"
    )
    return project


def test_a_warm_interpreter_runs_pytest_in_the_directory_and_environment_handed_to_it_later(tmp_path):
    project = _project(tmp_path)
    warm = WarmPytest.start(PYTHON, _env(), ["json"])
    lines: list[str] = []
    junit = tmp_path / "junit.xml"
    result = warm.run(
        ["-q", "-p", "no:cacheprovider", f"--junitxml={junit}", f"--rootdir={project}", "test_it.py"],
        _env(TG_WARM_SEEN="late"),
        str(project),
        tmp_path / "pytest.log",
        timeout_s=300,
        on_line=lines.append,
    )
    out = "\n".join(lines)
    assert result.returncode == 1, out
    assert "1 failed, 1 passed" in out
    assert "At index 1 diff: 2 != 3" in out  # pytest's rewritten assert, not a bare AssertionError
    assert "PytestAssertRewriteWarning" not in out  # nothing pytest rewrites (its plugins) was imported early
    assert junit.exists()
    assert "1 failed, 1 passed" in (tmp_path / "pytest.log").read_text()


def test_a_warm_interpreter_given_no_arguments_ends_quietly_when_its_input_closes():
    warm = WarmPytest.start(PYTHON, _env(), [])
    assert warm.popen.stdin is not None and warm.popen.stdout is not None
    warm.popen.stdin.close()
    assert warm.popen.wait(timeout=120) == 0
    assert warm.popen.stdout.read() == ""
    warm.popen.stdout.close()


def test_a_discarded_warm_interpreter_is_gone():
    warm = WarmPytest.start(PYTHON, _env(), [])
    warm.discard()
    assert warm.popen.poll() == -9  # killed: it had started nothing


def test_the_contract_tests_interpreter_has_loaded_what_an_optimizer_constructor_imports(tmp_path):
    # An optimizer's constructor imports TorchDynamo: loaded ahead, the contract tests do not wait on it.
    (tmp_path / "test_opt.py").write_text(
        "import sys\nimport torch\n\n"
        "def test_no_import_left():\n"
        "    before = set(sys.modules)\n"
        "    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)\n"
        "    assert sorted(set(sys.modules) - before) == []\n"
    )
    warm = WarmPytest.start(PYTHON, _env(), CONTRACT_PRELOAD)
    lines: list[str] = []
    result = warm.run(
        ["-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}", "test_opt.py"],
        _env(),
        str(tmp_path),
        tmp_path / "pytest.log",
        timeout_s=300,
        on_line=lines.append,
    )
    assert result.returncode == 0, "\n".join(lines)


def test_a_built_in_recipes_tests_forked_from_an_engine_run_as_a_fresh_interpreter_would_and_otherwise_cold(
        tmp_path):
    """The engine here is a process pool's flow-run zygote (flows.warm_engine), with torch, pytest and the contract
    tests' imports loaded; the kept server's CLI engine forks the same request the same way."""
    sock = tmp_path / "engine" / "zygote.sock"
    sock.parent.mkdir(mode=0o700)
    log = tmp_path / "zygote.log"
    with open(log, "w") as f:
        zygote = subprocess.Popen([PYTHON, "-m", "flows.warm_engine", "--serve", str(sock), str(os.getpid())],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=f, stderr=subprocess.STDOUT,
                                  cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while "ready on" not in log.read_text():
            assert zygote.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        project = _project(tmp_path)
        lib = tmp_path / "lib"
        lib.mkdir()
        (lib / "on_its_path.py").write_text("WHERE = 'lib'\n")
        (project / "test_path.py").write_text(
            "import on_its_path\n\ndef test_pythonpath():\n    assert on_its_path.WHERE == 'lib'\n")
        for extra in ({}, {"PYTHONHASHSEED": "7"}):
            # PYTHONHASHSEED acts as an interpreter starts: an engine whose own differs does not fork, the run
            # starts cold; PYTHONPATH and PYTHONDONTWRITEBYTECODE the forked run applies itself.
            env = _env(PYTHONPATH=str(lib), **extra)
            warm = WarmPytest.start(PYTHON, env, CONTRACT_PRELOAD, engine=str(sock))
            lines: list[str] = []
            result = warm.run(["-q", "-p", "no:cacheprovider", f"--rootdir={project}", "test_it.py", "test_path.py"],
                              {**env, "TG_WARM_SEEN": "late"}, str(project), tmp_path / "pytest.log",
                              timeout_s=300, on_line=lines.append)
            out = "\n".join(lines)
            assert result.returncode == 1, out
            assert "1 failed, 2 passed" in out and "At index 1 diff: 2 != 3" in out
            assert "PytestAssertRewriteWarning" not in out
            assert not list(project.rglob("__pycache__")), "bytecode written under PYTHONDONTWRITEBYTECODE"
            assert len(re.findall(r"forked \d+ for a unit stage's tests", log.read_text())) == 1, log.read_text()
        assert "a unit stage's tests start cold: the tests' ['PYTHONHASHSEED'] differ" in log.read_text()
    finally:
        zygote.kill()
        zygote.wait()
