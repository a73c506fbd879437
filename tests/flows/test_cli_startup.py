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


# A worker's flow run loads the ladder's flow module before anything starts, and a script recipe's run needs no
# torch in the flow's process at all (a built-in recipe's imports it at its data snapshot).
MODULES = {forbidden: [f"flows.cli.{cmd}" for cmd in sorted(NEEDS) if NEEDS[cmd] == forbidden]
           for forbidden in set(NEEDS.values())}
MODULES[("torch",)].append("flows.pipeline")
# Imports the modules named in argv one after the other; prints, for each, the top-level packages it loaded first.
PROBE = """
import importlib, json, sys
first = {}
for name in sys.argv[1:]:
    before = {m.split('.')[0] for m in sys.modules}
    importlib.import_module(name)
    first[name] = sorted({m.split('.')[0] for m in sys.modules} - before)
print(json.dumps(first))
"""


@pytest.mark.parametrize("forbidden", sorted(MODULES), ids="-".join)
def test_no_commands_module_imports_what_it_must_not_nor_does_the_ladders_flow_module_import_torch(forbidden):
    # One interpreter per forbidden set: if importing all of its modules in turn loads none of the set, no one of
    # them does alone; a failure names the module that loaded a forbidden package first.
    p = subprocess.run([PYTHON, "-c", PROBE, *MODULES[forbidden]], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    first = json.loads(p.stdout.strip().splitlines()[-1])
    assert list(first) == MODULES[forbidden], p.stdout
    assert {m: sorted(set(new) & set(forbidden)) for m, new in first.items() if set(new) & set(forbidden)} == {}


def test_validating_the_demo_spec_imports_neither_prefect_mlflow_torch_nor_optuna():
    p = _run("validate", "examples/digits.yaml")
    assert p.returncode == 0, p.stderr
    assert "# spec ok: hash" in p.stderr
    assert json.loads(p.stderr.strip().splitlines()[-1]) == [], p.stderr




def test_the_traingate_process_loads_only_the_hand_over_and_the_standard_library_before_the_engine_runs_it():
    # What `traingate run` imports before handing the command to the CLI engine is its own time before the engine's
    # fork: the hand-over's modules and the standard library, no settings module, no third-party package.
    code = """
import json, sys
before = set(sys.modules)
import flows.cli
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.split('.')[0] not in sys.stdlib_module_names)))
"""
    p = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == ["flows", "flows.cli", "flows.cli_forward", "flows.server_mode", "traingate",
                                    "traingate.commandenv", "traingate.runtime", "traingate.runtime.handoff"]
