"""A process pool's command, flows/warm_engine.py: without a zygote to fork from it is Prefect's own engine.

The warm path (a worker wrapped by ``--worker``, flow runs forked from its zygote) runs the ladder deployments
in tests/flows/test_deployments.py."""

from __future__ import annotations

import os
import subprocess

import pytest
from tgtest import PYTHON, ROOT

from traingate.settings import ENGINE_SOCKET_VAR


def _entry(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "flows.warm_engine", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("socket_path", [None, "/nonexistent/zygote.sock"])
def test_without_a_zygote_the_entry_runs_prefects_engine_itself(socket_path):
    env = {k: v for k, v in os.environ.items() if k != ENGINE_SOCKET_VAR}
    if socket_path:
        env[ENGINE_SOCKET_VAR] = socket_path
    p = _entry({**env, "PREFECT__FLOW_RUN_ID": "not-a-flow-run-id"})
    # prefect.engine's own answer to a bad flow run id: the process the worker watches is Prefect's engine.
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Invalid flow run id" in p.stdout + p.stderr


def test_the_entry_refuses_arguments_it_does_not_take_in_one_line():
    p = _entry(dict(os.environ), "--bogus")
    assert p.returncode == 64
    assert p.stderr.count("\n") == 1 and "usage:" in p.stderr


def test_the_engines_build_prefects_models_before_they_fork():
    # Prefect's models build their validators on first use; an engine builds them once, so no forked command does.
    # In a fresh interpreter: some are not built after the imports (else the preload does nothing), all are after.
    code = """
import sys
import flows.pipeline
from pydantic import BaseModel
from flows import cli_engine, warm_engine

def unbuilt():
    return [f"{n}.{k}" for n, m in list(sys.modules.items()) if m is not None and n.startswith(warm_engine.PREFECT_MODELS)
            for k, v in list(vars(m).items()) if isinstance(v, type) and issubclass(v, BaseModel)
            and v.__module__ == n and not v.__pydantic_complete__]

assert "prefect.client.schemas.actions.FlowRunCreate" in unbuilt(), unbuilt()
assert "flows.warm_engine:build_prefect_models" in warm_engine.PRELOADED
assert "flows.warm_engine:build_prefect_models" in cli_engine.PRELOADED
warm_engine.build_prefect_models()
assert unbuilt() == [], unbuilt()
"""
    p = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
