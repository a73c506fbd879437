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
from traingate.spec import RunSpec


@task(name="unit-tests", cache_policy=NONE, retries=0)
def run_unit_tests(spec: RunSpec, spec_path: str, stage_dir: str) -> StageResult:
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
    env = {**os.environ, envvars.UNIT_SPEC: spec_path, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        f"--rootdir={cwd}",
        *targets,
    ]
    if not targets:
        log.warning("recipe.script.tests is empty: the unit stage has nothing to run")
        cmd = [sys.executable, "-c", "import sys; sys.exit(5)"]
    t0 = time.monotonic()
    result = proc.run(cmd, env, cwd, out / "pytest.log", timeout_s=1800, on_line=log.info)
    return outcomes.from_pytest(result, junit, time.monotonic() - t0)
