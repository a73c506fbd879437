"""A script stage's cost is estimated by one function: the dry run (`traingate run --dry-run`, from the
latest canary MLflow holds) prints what the gate before the stage checks budgets with (the canary's
StageResult estimate), and its ceiling is the stage's StageJob timeout, a script's own when lower."""
from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient

from traingate.job import sizing
from traingate.job.stagejob import derive
from traingate.job.vocab import Status
from traingate.ladder import outcomes
from traingate.ladder.plan import plan
from traingate.ladder.preflight import check_spec
from traingate.settings import Settings
from traingate.spec import parse_spec
from traingate.supervision.supervisor import Hooks, supervise
from traingate.tracking.prior import latest_canary_profile
from traingate.tracking.runs import record_stage

TRAIN = """
import time
for step in range(1, 11):
    time.sleep(0.02)
    print(f"step {step} loss {1.0 / step:.3f}", flush=True)
"""


@pytest.mark.slow  # a script canary under the supervisor, recorded in MLflow (~10 s here)
def test_the_dry_run_estimates_a_script_stage_with_the_runs_own_estimator(tmp_path, state_dir, monkeypatch):
    monkeypatch.setenv("TRAINGATE_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    workdir = tmp_path / "project"
    workdir.mkdir()
    (workdir / "train.py").write_text(TRAIN)
    spec = parse_spec({"identity": {"experiment": "scripts", "owner": "tester", "team": "platform",
                                    "purpose": "estimate a script's stages"},
                       "recipe": {"name": "script", "script": {"workdir": str(workdir), "timeout_s": 60,
                                                                "metrics": [r"step (?P<step>\d+) loss (?P<loss>\S+)"],
                                                                "command": ["python", "train.py"]}},
                       "resources": {"work_pool": "gpu-a100", "procs_per_node": 1},
                       "tracking": {"enabled": False}})
    samples = check_spec(spec)
    settings = Settings.from_env()
    canary = derive(spec, "canary", run_id="est", run_dir=settings.state_dir / "runs" / "est", settings=settings)
    t0 = time.monotonic()
    sup = supervise(canary, Hooks(), seed=0)
    result = outcomes.from_supervision(canary, sup, time.monotonic() - t0)
    assert result.status == Status.COMPLETED and result.metrics["steps"] == 10, result.error
    the_run_estimates = result.estimate["next_stage_cost_usd"]

    # The canary as the run records it; the dry run reads it back from MLflow.
    c = MlflowClient(settings.tracking_uri)
    exp = c.create_experiment("scripts", artifact_location=(tmp_path / "artifacts").as_uri())
    run = c.create_run(exp, tags={"traingate.stage": "canary", "traingate.recipe": "script"})
    record_stage(c, run.info.run_id, result, None)
    prior = latest_canary_profile(settings, "scripts", "script")
    full = plan(spec, samples, "full", profile=prior)[-1]
    assert full["stage"] == "full" and full["est_cost_usd"] == the_run_estimates > 0

    job = derive(spec, "full", run_id="est", run_dir=settings.state_dir / "runs" / "est", settings=settings)
    assert job.timeout_s == 60  # the script's own timeout, below the stage's 3600 s
    assert full["cost_ceiling_usd"] == sizing.cost_usd(job.timeout_s, job.slots, job.price_per_slot_hour)
