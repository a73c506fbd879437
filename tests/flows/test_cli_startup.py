"""`traingate --help` and `--version` answer at once: nothing heavy is imported to print them."""
from __future__ import annotations

import json
import subprocess
from importlib.metadata import version

import pytest

from tgtest import PYTHON, ROOT

HEAVY = ("prefect", "mlflow", "torch", "optuna")

_PROBE = """
import json, sys
from flows.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(%r))), file=sys.stderr)
""" % (HEAVY,)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", _PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"], ["validate", "--help"],
                                  ["resume", "--help"], ["show", "--help"]], ids=" ".join)
def test_help_and_version_import_neither_prefect_mlflow_torch_nor_optuna(argv):
    p = _run(*argv)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stderr.strip().splitlines()[-1]) == [], p.stderr
    assert p.stdout.strip()


def test_version_prints_the_installed_distributions_version():
    p = subprocess.run([PYTHON, "-m", "flows.cli", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"traingate {version('traingate')}"


# What each command's module must not import: none of them trains, so none imports torch; validate sends nothing
# anywhere and watch (and run's progress view, terminal) reads the stage directories, so neither imports a tracking
# client. (`resume`, `sweep` and `ci` start the ladder flow in their process.)
NEEDS = {**{cmd: ("prefect", "mlflow", "torch", "optuna") for cmd in ("validate", "watch", "terminal")},
         "queue": ("mlflow", "torch", "optuna"), **{cmd: ("torch",) for cmd in ("run", "show", "runs", "cost")}}


@pytest.mark.parametrize("cmd", sorted(NEEDS))
def test_a_commands_module_imports_no_torch(cmd):
    code = f"import json, sys, flows.cli.{cmd}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    p = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert set(json.loads(p.stdout)) & set(NEEDS[cmd]) == set()


def test_validating_the_demo_spec_imports_neither_prefect_mlflow_torch_nor_optuna():
    p = _run("validate", "examples/digits.yaml")
    assert p.returncode == 0, p.stderr
    assert "# spec ok: hash" in p.stderr
    assert json.loads(p.stderr.strip().splitlines()[-1]) == [], p.stderr


def test_the_ladder_flows_module_imports_no_torch():
    # A worker's flow run loads it before anything starts, and a script recipe's run needs no torch in the
    # flow's process at all (a built-in recipe's imports it at its data snapshot).
    code = "import json, sys, flows.pipeline; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    p = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "torch" not in json.loads(p.stdout)
