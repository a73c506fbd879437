"""A run's budget through the real CLI: `traingate run` pauses when the run crosses
`budget.max_run_usd` mid-stage; `traingate resume RUN --set budget.max_run_usd=...` finishes it.

Real everything: the CLI subprocess on the session's Prefect server, MLflow on SQLite, torchrun."""
from __future__ import annotations

import os
import subprocess

import pytest

from tgtest import PYTHON, ROOT
from traingate.job import files

pytestmark = pytest.mark.slow


def test_a_run_paused_by_its_budget_resumes_to_the_end_once_the_budget_is_raised(prefect_api, tiny_spec, tmp_path,
                                                                                  monkeypatch, capsys):
    from flows.cli import main

    env = {**os.environ, "TRAINGATE_STATE_DIR": str(tmp_path / "state"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PYTHONUNBUFFERED": "1", "TRAINGATE_INJECT": "slow@0:0", **prefect_api}
    # $100 a slot-hour, one slot: 2.8 cents a second against 15 cents; smoke's 80 steps take 8 s of training.
    args = ["--until", "smoke", "--set", "stages.smoke.max_steps=80", "--set", "resources.procs_per_node=1",
            "--set", "pools.cpu-local.price_per_gpu_hour=100", "--set", "budget.max_run_usd=0.15"]
    p = subprocess.run([PYTHON, "-m", "flows.cli", "run", str(tiny_spec()), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    run_id = next((tmp_path / "state" / "runs").glob("*")).name
    assert p.returncode == 1, out[-4000:]
    assert "paused by alert budget-exhausted: budget-exhausted: run spent $" in out, out[-4000:]
    assert f"traingate resume {run_id}" in out
    run_dir = tmp_path / "state" / "runs" / run_id
    assert "budget-exhausted" in [a.rule for a in files.read_alerts(run_dir / "smoke")]
    assert any(e.kind == "alert" and "budget-exhausted" in e.text for e in files.read_logbook(run_dir))

    # A bad budget is refused before anything starts; in this process (a CLI process would only add its start-up).
    for k in ("TRAINGATE_STATE_DIR", *prefect_api):
        monkeypatch.setenv(k, env[k])
    capsys.readouterr()
    code = main(["resume", run_id, "--until", "smoke", "--set", "budget.max_run_usd=-1"])
    said = capsys.readouterr()
    assert code == 2 and "budget.max_run_usd" in said.err + said.out, said.err + said.out

    p = subprocess.run([PYTHON, "-m", "flows.cli", "resume", run_id, "--until", "smoke", "--set",
                        "budget.max_run_usd=100"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "resume PASSED" in p.stdout
    assert "max_run_usd: 100" in (run_dir / "spec.yaml").read_text()  # the raised budget holds for later resumes
