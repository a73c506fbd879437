"""The unit stage's pytest run, cold against warm, alone: what the ladder's serial path pays for it.

Cold is ``python -m pytest`` of the built-in recipe's contract tests, started when its arguments exist (the
unit stage as run_unit_tests starts one without a warm interpreter). Warm is the interpreter
``tasks.unit.start_unit_tests`` starts ahead (traingate.launch.warm_pytest: pytest, torch and the tests'
imports loaded), handed the same arguments once it waits on its input, as the ladder hands it them after the
data snapshot and the MLflow runs. Each is timed from the moment its arguments exist to its exit, the
contract tests of ``examples/digits.yaml``, alternated ``TRAINGATE_BENCH_UNIT_ROUNDS`` times (default 3) in
one invocation; the warm one's own start and imports, which the ladder overlaps, are reported beside it.
A third run per round is warm without TorchDynamo among its imports (an optimizer's constructor imports it
inside the contract tests then).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tasks.unit import CONTRACT_PRELOAD, unit_env
from traingate.launch import proc
from traingate.launch.warm_pytest import WarmPytest
from traingate.recipes import checks
from traingate.spec import load_spec, write_resolved

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "digits.yaml"


def _waiting_on_input(pid: int, deadline: float) -> None:
    """Until the warm interpreter has done its imports: asleep (blocked on its input) for a second."""
    p, since = psutil.Process(pid), None
    while time.monotonic() < deadline:
        if p.status() == psutil.STATUS_SLEEPING and p.cpu_percent(interval=0.2) == 0.0:
            since = since or time.monotonic()
            if time.monotonic() - since >= 1.0:
                return
        else:
            since = None
    raise TimeoutError(f"warm interpreter {pid} still importing")


def _one(tmp: Path, warm: list[str] | None, spec_path: Path, r: int) -> tuple[float, float]:
    """``warm``: the warm interpreter's imports (None: cold)."""
    out = tmp / f"{'cold' if warm is None else len(warm)}-{r}"
    out.mkdir()
    tests = str(Path(checks.__file__).with_name("test_recipe_contract.py"))
    args = ["-q", "-p", "no:cacheprovider", f"--junitxml={out / 'junit.xml'}", f"--rootdir={out}", tests]
    env = unit_env(str(spec_path))
    ahead = 0.0
    if warm is not None:
        t0 = time.monotonic()
        w = WarmPytest.start(sys.executable, unit_env(), warm)
        _waiting_on_input(w.popen.pid, time.monotonic() + 600)
        ahead = time.monotonic() - t0 - 1.0  # less the second it was seen waiting
        t0 = time.monotonic()
        result = w.run(args, env, str(out), out / "pytest.log", timeout_s=600)
    else:
        t0 = time.monotonic()
        result = proc.run([sys.executable, "-m", "pytest", *args], env, str(out), out / "pytest.log", timeout_s=600)
    took = time.monotonic() - t0
    if result.returncode != 0:
        raise RuntimeError(f"contract tests failed ({'cold' if warm is None else warm}): {result.tail[-10:]}")
    return took, ahead


def main() -> str:
    rounds = int(os.environ.get("TRAINGATE_BENCH_UNIT_ROUNDS", "3"))
    cold, warm, ahead, no_dynamo, loads = [], [], [], [], []
    without = [m for m in CONTRACT_PRELOAD if m != "torch._dynamo"]
    with tempfile.TemporaryDirectory(prefix="tg-bench-unit-") as t:
        tmp = Path(t)
        spec_path = tmp / "spec.yaml"
        write_resolved(load_spec(SPEC), spec_path)
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            cold.append(_one(tmp, None, spec_path, r)[0])
            took, before = _one(tmp, CONTRACT_PRELOAD, spec_path, r)
            warm.append(took)
            ahead.append(before)
            no_dynamo.append(_one(tmp, without, spec_path, r)[0])

    def cell(values: list[float]) -> str:
        return f"{', '.join(f'{v:.1f}' for v in values)} (median {statistics.median(values):.1f})"

    return "\n".join(
        [
            "| unit stage's pytest run, contract tests of examples/digits.yaml (s) | per round |",
            "|---|---|",
            f"| cold: `python -m pytest`, arguments -> exit | {cell(cold)} |",
            f"| warm: arguments handed -> exit | {cell(warm)} |",
            f"| warm without TorchDynamo loaded ahead: arguments handed -> exit | {cell(no_dynamo)} |",
            f"| warm: its start and imports, before the arguments (overlapped by the ladder) | {cell(ahead)} |",
            f"| load average (1 min) at each round's start | {', '.join(f'{v:.1f}' for v in loads)} |",
        ]
    )
