"""The ladder's MLflow records: one parent run per pipeline, one child run per stage.

Only the orchestrator creates and closes runs; training processes write into the
stage run they are handed (MLFLOW_RUN_ID).
"""
from __future__ import annotations

import json
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from traingate.redact import redact, redact_mapping
from traingate.spec import RunSpec
from traingate.stage import GateDecision, StageResult, render_markdown
from traingate.tracking.identity import REQUIRED_TAGS

_MAX_PARAM = 6000  # MLflow's param value limit


def client(tracking_uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri)


def experiment_id(c: MlflowClient, name: str, artifact_uri: str | None) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    return c.create_experiment(name, artifact_location=f"{artifact_uri.rstrip('/')}/{name}" if artifact_uri else None)


def open_pipeline_run(c: MlflowClient, spec: RunSpec, artifact_uri: str | None, identity: dict[str, Any]) -> str:
    """Create the parent run with the full identity; returns its id (the traingate run id)."""
    exp = experiment_id(c, spec.identity.experiment, artifact_uri)
    name = spec.identity.run_name or f"{spec.recipe.name}-{spec.spec_hash()[:6]}"
    run = c.create_run(exp, run_name=name, tags={"traingate.kind": "pipeline"})
    rid = run.info.run_id
    tags = {
        "traingate.run_id": rid, "traingate.experiment": spec.identity.experiment,
        "traingate.owner": spec.identity.owner, "traingate.team": spec.identity.team,
        "traingate.purpose": spec.identity.purpose, "traingate.recipe": spec.recipe.name,
        "traingate.code_version": identity["code"]["sha"], "traingate.code_dirty": identity["code"]["dirty"],
        "traingate.code_diff_hash": identity["code"].get("diff_hash", ""),
        "traingate.data_snapshot": identity["data_snapshot"], "traingate.data_uri": redact(identity["data_uri"]),
        "traingate.spec_hash": spec.spec_hash(), "traingate.work_pool": spec.resources.work_pool,
        "mlflow.user": spec.identity.owner,
    }
    tags["traingate.identity_valid"] = str(identity_complete(tags)).lower()
    params = [Param(k, redact(v)[:_MAX_PARAM]) for k, v in sorted(spec.flat().items())]
    for i in range(0, len(params), 100):
        c.log_batch(rid, params=params[i:i + 100])
    c.log_batch(rid, tags=[RunTag(k, v) for k, v in tags.items()])
    c.log_dict(rid, redact_mapping(spec.to_dict()), "spec/resolved_spec.json")
    c.log_dict(rid, identity["environment"], "identity/environment.json")
    return rid


def identity_complete(tags: dict[str, str]) -> bool:
    return all(tags.get(t) not in (None, "", "unknown", "undeclared") for t in REQUIRED_TAGS)


def open_stage_run(c: MlflowClient, parent_run_id: str, stage: str) -> str:
    parent = c.get_run(parent_run_id)
    inherited = {k: v for k, v in parent.data.tags.items() if k.startswith("traingate.") and k != "traingate.kind"}
    run = c.create_run(parent.info.experiment_id, run_name=f"{parent.info.run_name}/{stage}",
                       tags={**inherited, "mlflow.parentRunId": parent_run_id, "traingate.kind": "stage",
                             "traingate.stage": stage})
    return run.info.run_id


def record_stage(c: MlflowClient, stage_run_id: str, result: StageResult, decision: GateDecision | None) -> None:
    """Log a stage's result and gate decision, then close its run."""
    metrics = [Metric(f"stage.{k}", v, 0, 0) for k, v in result.numeric_metrics().items()]
    metrics += [Metric("stage.cost_usd", result.cost_usd, 0, 0), Metric("stage.duration_s", result.duration_s, 0, 0)]
    metrics += [Metric(f"estimate.{k}", float(v), 0, 0) for k, v in result.estimate.items()]
    tags = [RunTag("traingate.stage_status", result.status)]
    if result.checkpoint_uri:
        tags.append(RunTag("traingate.checkpoint_uri", redact(result.checkpoint_uri)))
    if decision is not None:
        tags += [RunTag("traingate.gate_passed", str(decision.passed).lower()),
                 RunTag("traingate.gate_reasons", redact("; ".join(decision.reasons))[:5000])]
    for i in range(0, len(metrics), 500):
        c.log_batch(stage_run_id, metrics=metrics[i:i + 500], tags=tags if i == 0 else [])
    c.log_text(stage_run_id, redact(render_markdown(result, decision)), "gate/report.md")
    c.log_text(stage_run_id, redact(json.dumps(result.to_dict(), indent=1, default=str)), "stage/result.json")
    ok = result.status == "completed" and (decision is None or decision.passed)
    c.set_terminated(stage_run_id, "FINISHED" if ok else "FAILED")


def close_pipeline_run(c: MlflowClient, run_id: str, passed: bool, reached: str, reason: str = "") -> None:
    c.log_batch(run_id, tags=[RunTag("traingate.reached_stage", reached),
                              RunTag("traingate.outcome", "passed" if passed else "stopped"),
                              RunTag("traingate.stop_reason", redact(reason)[:5000])])
    c.set_terminated(run_id, "FINISHED" if passed else "FAILED")
