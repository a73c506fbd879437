"""The unit stage: a pytest run of the recipe's training-code tests."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

import traingate.recipes.checks as checks
from traingate.job import envvars
from traingate.job.result import StageResult
from traingate.ladder import outcomes
from traingate.launch import proc
from traingate.launch.pytest_child import CONTRACT_PRELOAD
from traingate.launch.warm_pytest import WarmPytest
from traingate.settings import ENGINE_SOCKET_VAR
from traingate.spec import RunSpec


def start_unit_tests(spec: RunSpec) -> WarmPytest | None:
    """The unit stage's pytest process, started now; it runs nothing until :func:`run_unit_tests` hands it its
    arguments. A built-in recipe's contract tests are forked from the engine this flow run was forked from (the
    process pool's flow-run zygote or the kept server's CLI engine: ``TRAINGATE_ENGINE_SOCKET``), which holds their
    imports already; without one, the process imports pytest and them itself, now. A script's tests import what
    they import, and never run in an interpreter holding traingate's modules (a module of the script's may share a
    name with one of them): a fresh interpreter with only pytest loaded. None for a script that names no tests:
    nothing is started for a stage that runs nothing."""
    if spec.recipe.name == "script":
        assert spec.recipe.script is not None
        return WarmPytest.start(sys.executable, unit_env(), []) if spec.recipe.script.tests else None
    return WarmPytest.start(sys.executable, unit_env(), CONTRACT_PRELOAD, engine=os.environ.get(ENGINE_SOCKET_VAR))


def unit_env(spec_path: str | None = None) -> dict[str, str]:
    """The unit stage's environment: this process's, no bytecode written, and the resolved spec's path."""
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **({envvars.UNIT_SPEC: spec_path} if spec_path else {})}


NO_TESTS_COLLECTED = 5  # pytest's exit status when it collected nothing


@task(name="unit-tests", cache_policy=NONE, retries=0)
def run_unit_tests(spec: RunSpec, spec_path: str, stage_dir: str, warm: WarmPytest | None = None) -> StageResult:
    """``warm``: the interpreter :func:`start_unit_tests` started for this run (None: one starts here)."""
    log = get_run_logger()
    out = Path(stage_dir)
    out.mkdir(parents=True, exist_ok=True)
    junit = out / "junit.xml"
    if spec.recipe.name == "script":
        s = spec.recipe.script
        assert s is not None
        targets, cwd = list(s.tests), s.workdir
    else:
        targets, cwd = [str(Path(checks.__file__).with_name("test_recipe_contract.py"))], str(out)
    env = unit_env(spec_path)
    args = [
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        f"--rootdir={cwd}",
        *targets,
    ]
    t0 = time.monotonic()
    if not targets:
        why = "recipe.script.tests is empty: the unit stage has nothing to run"
        log.warning(why)
        if warm is not None:
            warm.discard()
        (out / "pytest.log").write_text(why + "\n")
        result = proc.ProcResult(returncode=NO_TESTS_COLLECTED, duration_s=0.0, tail=[why])
    elif warm is not None:
        result = warm.run(args, env, cwd, out / "pytest.log", timeout_s=1800, on_line=log.info)
    else:
        cmd = [sys.executable, "-m", "pytest", *args]
        result = proc.run(cmd, env, cwd, out / "pytest.log", timeout_s=1800, on_line=log.info)
    return outcomes.from_pytest(result, junit, time.monotonic() - t0)
