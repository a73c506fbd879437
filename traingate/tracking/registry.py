"""Promotion: the full stage's final model, logged as an MLflow model and registered with an alias.

Registration happens only if :func:`traingate.tracking.runs.can_promote` agrees (full
stage, completed, gate passed, identity complete); otherwise the run is tagged with
why it was refused.
"""
from __future__ import annotations

from typing import Any

from mlflow.tracking import MlflowClient

from traingate.spec import RunSpec
from traingate.tracking.runs import can_promote

CANDIDATE = "candidate"


def model_name(spec: RunSpec) -> str:
    return f"{spec.identity.experiment}-{spec.recipe.name}"


def _final_model(spec: RunSpec, checkpoint_uri: str) -> tuple[Any, Any]:
    """The model of the newest checkpoint, and two validation inputs as an example for its signature."""
    from traingate.recipes import get_recipe
    from traingate.runtime.checkpoint import Checkpointer

    ckpt = Checkpointer(checkpoint_uri, async_save=False)
    step = ckpt.find_latest()
    if step is None:
        raise ValueError(f"no valid checkpoint under {checkpoint_uri}; the full stage left no model to register")
    recipe = get_recipe(spec)
    model = recipe.build_model()
    model.load_state_dict(ckpt.load(step)["model"])
    _, val = recipe.load_data()
    return model.eval(), val.batch(range(min(2, len(val))))[0].numpy()


def register_candidate(c: MlflowClient, spec: RunSpec, stage_run_id: str, checkpoint_uri: str | None,
                       alias: str = CANDIDATE) -> dict[str, Any]:
    """Log the final model into the full stage's run and register it with ``alias``, if the run may be promoted."""
    ok, reasons = can_promote(c, stage_run_id)
    if ok and (spec.recipe.name == "script" or not checkpoint_uri):
        ok, reasons = False, ["no model checkpoint: script recipes register their own models"]
    if not ok:
        c.set_tag(stage_run_id, "traingate.promotion", ("refused: " + "; ".join(reasons))[:5000])
        return {"registered": False, "reasons": reasons}

    import mlflow
    import mlflow.pytorch
    import torch

    model, example = _final_model(spec, checkpoint_uri)
    mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API is process-global; model logging needs it
    with mlflow.start_run(run_id=stage_run_id):
        # pickle, not pt2: export tracing does not hold for every recipe's model (e.g. variable-length input)
        info = mlflow.pytorch.log_model(model, name="model", serialization_format="pickle", input_example=example,
                                        pip_requirements=[f"torch=={torch.__version__}"])
    tags = c.get_run(stage_run_id).data.tags
    name = model_name(spec)
    version = mlflow.register_model(info.model_uri, name, tags={
        "traingate.run_id": tags.get("traingate.run_id", ""), "traingate.stage_run_id": stage_run_id,
        "traingate.spec_hash": tags.get("traingate.spec_hash", ""),
        "traingate.code_version": tags.get("traingate.code_version", ""),
        "traingate.data_snapshot": tags.get("traingate.data_snapshot", "")})
    c.set_registered_model_alias(name, alias, version.version)
    c.set_tag(stage_run_id, "traingate.promotion", f"registered {name} v{version.version} @{alias}")
    c.set_tag(stage_run_id, "traingate.model_uri", f"models:/{name}@{alias}")
    return {"registered": True, "name": name, "version": version.version, "alias": alias,
            "model_uri": f"models:/{name}@{alias}"}
