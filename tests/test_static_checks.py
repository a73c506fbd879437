"""The linter and the type checker find nothing in traingate/, flows/ and tasks/ (pyproject.toml's settings).

A file of its own, marked `long`: the type checker's cold run is the longest test of the fast lane, and a
long file is handed to an xdist worker first (tests/conftest.py) instead of last.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from tgtest import PYTHON, ROOT


def test_ruff_finds_nothing_in_traingate_flows_and_tasks():
    ruff = str(Path(PYTHON).parent / "ruff")  # pyproject.toml's [tool.ruff]: rules E, F, I, B, UP; 120 columns
    for command in (["check"], ["format", "--check"]):
        p = subprocess.run([ruff, *command, "--no-cache", "traingate", "flows", "tasks"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"ruff {' '.join(command)}:\n{p.stdout[-6000:]}{p.stderr[-2000:]}"


@pytest.mark.long
def test_mypy_finds_nothing_in_traingate_flows_and_tasks():
    # pyproject.toml's [tool.mypy]. Its cache lives in the system's temp dir: cold, a run takes 30 s of CPU.
    cache = Path(tempfile.gettempdir()) / "traingate-mypy-cache"
    p = subprocess.run([PYTHON, "-m", "mypy", "--cache-dir", str(cache), "traingate", "flows", "tasks"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
