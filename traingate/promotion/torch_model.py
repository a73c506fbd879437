"""The full stage's final model as an MLflow PyTorch model: the one part of promotion that needs torch.

Kept apart so that the ladder flow, which imports :mod:`traingate.promotion.register`, starts without
torch and MLflow's PyTorch flavour (seconds): only a registration that logs a built-in recipe's model
imports this module.
"""

from __future__ import annotations

from typing import Any

import mlflow
import mlflow.pytorch
import torch
from mlflow.tracking import MlflowClient

from traingate.recipes import get_recipe
from traingate.runtime.checkpoint import Checkpointer
from traingate.settings import Settings, checkpoint_key
from traingate.spec import RunSpec


def final_model(spec: RunSpec, checkpoint_uri: str) -> tuple[Any, Any]:
    """The model of the newest checkpoint, and two validation inputs as an example for its signature."""

    # With the deployment's key: weights changed after training (checksum recomputed) are refused, not promoted.
    ckpt = Checkpointer(checkpoint_uri, async_save=False, key=checkpoint_key(Settings.from_env()))
    step = ckpt.find_latest()
    if step is None:
        raise ValueError(f"no valid checkpoint under {checkpoint_uri}; the full stage left no model to register")
    recipe = get_recipe(spec)
    model = recipe.build_model()
    model.load_state_dict(ckpt.load(step)["model"])
    _, val = recipe.load_data()
    return model.eval(), val.batch(range(min(2, len(val))))[0].numpy()


def log_final_model(c: MlflowClient, spec: RunSpec, stage_run_id: str, checkpoint_uri: str) -> str:
    """Log the final model on ``stage_run_id``; its model URI."""
    model, example = final_model(spec, checkpoint_uri)
    mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API is process-global; model logging needs it
    with mlflow.start_run(run_id=stage_run_id):
        # pickle, not pt2: export tracing does not hold for every recipe's model (e.g. variable-length input)
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            serialization_format="pickle",
            input_example=example,
            pip_requirements=[f"torch=={torch.__version__}"],
        )
    return info.model_uri
