"""The sweep's MLflow records: the sweep is a parent run, each trial a child run.

The parent run id is stored on the study, so a resumed sweep keeps writing into the same
parent. The training process of a trial logs its own metrics (train loss, intermediate
val_loss/val_accuracy) into the trial's child run through MLFLOW_RUN_ID.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from traingate.job.vocab import Status
from traingate.spec import RunSpec
from traingate.sweep.report import TrialOutcome
from traingate.tracking.runs import create_run_once, experiment_id

_STATUS = {Status.COMPLETED: "FINISHED", Status.PRUNED: "KILLED", Status.FAILED: "FAILED"}


def open_sweep_run(
    c: MlflowClient, spec: RunSpec, study: optuna.Study, artifact_uri: str | None, request_key: str
) -> str:
    rid = study.user_attrs.get("mlflow_parent_run_id")
    if rid:
        c.update_run(rid, status="RUNNING")
        return rid
    sw = spec.sweep
    assert sw is not None
    exp = experiment_id(c, spec.identity.experiment, artifact_uri)
    run = create_run_once(
        c,
        exp,
        request_key,
        f"sweep/{study.study_name}",
        {
            "traingate.kind": "sweep",
            "traingate.study": study.study_name,
            "traingate.sampler": sw.sampler,
            "traingate.scheduler": sw.scheduler.name,
            "traingate.owner": spec.identity.owner,
            "traingate.team": spec.identity.team,
            "traingate.purpose": spec.identity.purpose,
            "traingate.spec_hash": spec.spec_hash(),
            "mlflow.user": spec.identity.owner,
        },
    )
    rid = run.info.run_id
    params = {
        "sweep.sampler": sw.sampler,
        "sweep.scheduler": sw.scheduler.name,
        "sweep.n_trials": sw.n_trials,
        "sweep.max_concurrent": sw.max_concurrent,
        "sweep.stage": sw.stage,
        "sweep.objectives": json.dumps([o.model_dump() for o in sw.objectives]),
        "sweep.space": json.dumps({k: v.model_dump(exclude_none=True) for k, v in sw.space.items()})[:6000],
    }
    c.log_batch(rid, params=[Param(k, str(v)) for k, v in params.items()])
    study.set_user_attr("mlflow_parent_run_id", rid)
    return rid


def open_trial_run(
    c: MlflowClient, parent_run_id: str, label: str, params: dict[str, Any], tags: dict[str, str], request_key: str
) -> str:
    parent = c.get_run(parent_run_id)
    run = create_run_once(
        c,
        parent.info.experiment_id,
        request_key,
        f"{parent.info.run_name}/{label}",
        {"mlflow.parentRunId": parent_run_id, "traingate.kind": "trial", "traingate.trial_state": "RUNNING", **tags},
    )
    c.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])
    return run.info.run_id


def record_trial(
    c: MlflowClient, run_id: str, outcome: TrialOutcome, intermediate: list[tuple[int, float]], metric: str
) -> None:
    """Final metrics, the intermediate values the scheduler saw, the state; then close the run."""
    metrics = [Metric(f"trial.{k}", float(v), 0, 0) for k, v in outcome.metrics.items()]
    metrics += [Metric("trial.steps", float(outcome.steps), 0, 0), Metric("trial.cost_usd", outcome.cost_usd, 0, 0)]
    metrics += [Metric(f"reported.{metric}", v, 0, s) for s, v in intermediate]
    tags = [RunTag("traingate.trial_state", outcome.state.upper())]
    if outcome.pruned_at_step is not None:
        tags.append(RunTag("traingate.pruned_at_step", str(outcome.pruned_at_step)))
    if outcome.error:
        tags.append(RunTag("traingate.error", outcome.error[:5000]))
    for i in range(0, max(1, len(metrics)), 500):
        c.log_batch(run_id, metrics=metrics[i : i + 500], tags=tags if i == 0 else [])
    c.set_terminated(run_id, _STATUS[outcome.state])


def close_sweep_run(c: MlflowClient, run_id: str, summary: dict[str, Any], files: list[Path]) -> None:
    metrics = [
        Metric(f"sweep.{k}", float(v), 0, 0)
        for k, v in summary.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    tags = [RunTag(f"traingate.sweep_{k}", str(v)[:5000]) for k, v in summary.items() if isinstance(v, str)]
    c.log_batch(run_id, metrics=metrics, tags=tags)
    for f in files:
        c.log_artifact(run_id, str(f), "sweep")
    c.set_terminated(run_id, "FINISHED")
