"""Promotion: the full stage's final model, logged as an MLflow model and registered with an alias.

Registration happens only if :func:`traingate.tracking.runs.can_promote` agrees (full
stage, completed, gate passed, identity complete); otherwise the run is tagged with
why it was refused.

Registration is idempotent, because the task that calls it is retried: a stage run has at
most one registered version under its model name (a retry reuses the version whose source run
it is) and at most one logged model (a retry that failed between logging and registering
registers the model already logged).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

import mlflow
from mlflow.entities import LoggedModelStatus, Run
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from traingate.promotion.aliases import CANDIDATE, model_name, take_alias_if_better
from traingate.recipes import script
from traingate.redact import redact
from traingate.spec import RunSpec
from traingate.tracking.runs import can_promote


def registered_version(c: MlflowClient, name: str, run_id: str) -> ModelVersion | None:
    """The version of model ``name`` registered from ``run_id`` (the oldest, if an earlier bug made several)."""
    found = c.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def logged_model_uri(c: MlflowClient, run_id: str) -> str | None:
    """``models:/<id>`` of the final model already logged into ``run_id`` (complete uploads only), or None."""
    exp = c.get_run(run_id).info.experiment_id
    found = [
        m
        for m in c.search_logged_models([exp], filter_string=f"source_run_id = '{run_id}' AND name = 'model'")
        if m.status == LoggedModelStatus.READY
    ]
    return f"models:/{max(found, key=lambda m: m.creation_timestamp).model_id}" if found else None


def register_candidate(
    c: MlflowClient, spec: RunSpec, stage_run_id: str, checkpoint_uri: str | None, alias: str = CANDIDATE
) -> dict[str, Any]:
    """Log the final model into the full stage's run and register it with ``alias``, if the run may be promoted.

    Safe to call again for the same run (see the module docstring): the same version comes back.
    """
    run = c.get_run(stage_run_id)  # its identity, status, tags and metrics: what the checks and the version read
    ok, reasons = can_promote(c, stage_run_id, run)
    script = spec.recipe.script
    name = model_name(spec)
    version = registered_version(c, name, stage_run_id) if ok else None  # a retry's
    if ok and script is not None and script.checkpoints is None:
        ok, reasons = (
            False,
            [
                "no model checkpoint: the script declares no recipe.script.checkpoints, so traingate "
                "does not know which file is its model (script recipes register their own models)"
            ],
        )
    elif ok and not checkpoint_uri:
        ok, reasons = False, ["no model checkpoint: the full stage reported no checkpoint URI"]
    elif ok and script is not None and version is None and not _script_checkpoint_written(checkpoint_uri):
        ok, reasons = (
            False,
            [
                f"no model checkpoint: the script wrote no file matching recipe.script.checkpoints "
                f"({script.checkpoints!r}) under {redact(checkpoint_uri or '')}"
            ],
        )
    if not ok:
        c.set_tag(stage_run_id, "traingate.promotion", ("refused: " + "; ".join(reasons))[:5000])
        return {"registered": False, "reasons": reasons}

    if version is None and script is not None:
        assert checkpoint_uri is not None
        version = _register_script_checkpoint(c, name, run, checkpoint_uri)
    if version is None:
        assert checkpoint_uri is not None, "a run without one was refused above"
        model_uri = logged_model_uri(c, stage_run_id) or _log_final_model(c, spec, stage_run_id, checkpoint_uri)
        mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API is process-global
        version = mlflow.register_model(model_uri, name, tags=_version_tags(run))
    return take_alias_if_better(c, name, version.version, stage_run_id, alias, run)


def _script_checkpoint_written(checkpoint_uri: str | None) -> bool:
    """An index at the checkpoint URI that names a file."""
    return bool(checkpoint_uri and script.read_index(checkpoint_uri))


SCRIPT_MODEL_PATH = "checkpoint"  # the artifact directory of a script's registered checkpoint file


def _version_tags(run: Run) -> dict[str, str]:
    tags = run.data.tags
    return {
        "traingate.run_id": tags.get("traingate.run_id", ""),
        "traingate.stage_run_id": run.info.run_id,
        "traingate.spec_hash": tags.get("traingate.spec_hash", ""),
        "traingate.code_version": tags.get("traingate.code_version", ""),
        "traingate.data_snapshot": tags.get("traingate.data_snapshot", ""),
    }


def _register_script_checkpoint(c: MlflowClient, name: str, run: Run, checkpoint_uri: str) -> ModelVersion:
    """The newest checkpoint file a script declared, logged into the stage run (``checkpoint/<file>``, the
    index beside it under ``checkpoints/``) and registered as a version of ``name`` whose source is that
    artifact directory. The file is the model: traingate does not know how to load it, its user does.

    MLflow 3's ``register_model`` accepts only logged models for a ``runs:/`` URI; a model version whose
    source is a run's artifact directory is created with the client directly (the same record).
    """

    stage_run_id = run.info.run_id
    entries = script.read_index(checkpoint_uri)
    last = script.newest(entries)
    assert last is not None, "checked by _script_checkpoint_written"
    with tempfile.TemporaryDirectory(prefix="tg-script-model-") as tmp:
        local = script.fetch(checkpoint_uri, last, Path(tmp) / "model" / PurePosixPath(last.path).name)
        c.log_artifact(stage_run_id, str(local), SCRIPT_MODEL_PATH)
        index = Path(tmp) / "script-index.json"
        index.write_text(
            json.dumps(
                {"uri": redact(checkpoint_uri), "registered": last.path, "checkpoints": [e.__dict__ for e in entries]},
                indent=1,
            )
        )
        c.log_artifact(stage_run_id, str(index), "checkpoints")
    tags = {
        **_version_tags(run),
        "traingate.checkpoint_file": last.path,
        "traingate.checkpoint_sha256": last.sha256,
        "traingate.checkpoint_step": str(last.step or ""),
    }
    source = f"runs:/{stage_run_id}/{SCRIPT_MODEL_PATH}"
    try:  # the model is there but for its first version: a failed create (a rolled-back insert) costs more
        return c.create_model_version(name, source, run_id=stage_run_id, tags=tags)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    try:
        c.create_registered_model(name)
    except MlflowException as e:
        # Created meanwhile by another run registering at the same moment. Anything else is not.
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    return c.create_model_version(name, source, run_id=stage_run_id, tags=tags)


def _log_final_model(c: MlflowClient, spec: RunSpec, stage_run_id: str, checkpoint_uri: str) -> str:
    # lazy: torch and MLflow's PyTorch flavour take seconds; the ladder flow imports this module as it starts
    from traingate.promotion.torch_model import log_final_model

    return log_final_model(c, spec, stage_run_id, checkpoint_uri)
