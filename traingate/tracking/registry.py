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

import contextlib
import fcntl
import hashlib
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from mlflow.entities import LoggedModelStatus
from mlflow.entities.model_registry import ModelVersion
from mlflow.tracking import MlflowClient

from traingate.redact import redact
from traingate.settings import Settings

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
    ok, reasons = can_promote(c, stage_run_id)
    script = spec.recipe.script
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
    elif ok and script is not None and not _script_checkpoint_written(c, spec, stage_run_id, checkpoint_uri):
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

    import mlflow

    name = model_name(spec)
    version = registered_version(c, name, stage_run_id)
    if version is None and script is not None:
        assert checkpoint_uri is not None
        version = _register_script_checkpoint(c, name, stage_run_id, checkpoint_uri)
    if version is None:
        model_uri = logged_model_uri(c, stage_run_id) or _log_final_model(c, spec, stage_run_id, checkpoint_uri)
        mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API is process-global
        version = mlflow.register_model(model_uri, name, tags=_version_tags(c, stage_run_id))
    return take_alias_if_better(c, name, version.version, stage_run_id, alias)


def _script_checkpoint_written(c: MlflowClient, spec: RunSpec, stage_run_id: str, checkpoint_uri: str | None) -> bool:
    """A version registered already (a retry), or an index at the checkpoint URI that names a file."""
    from traingate.recipes import script

    return registered_version(c, model_name(spec), stage_run_id) is not None or bool(
        checkpoint_uri and script.read_index(checkpoint_uri)
    )


SCRIPT_MODEL_PATH = "checkpoint"  # the artifact directory of a script's registered checkpoint file


def _version_tags(c: MlflowClient, stage_run_id: str) -> dict[str, str]:
    tags = c.get_run(stage_run_id).data.tags
    return {
        "traingate.run_id": tags.get("traingate.run_id", ""),
        "traingate.stage_run_id": stage_run_id,
        "traingate.spec_hash": tags.get("traingate.spec_hash", ""),
        "traingate.code_version": tags.get("traingate.code_version", ""),
        "traingate.data_snapshot": tags.get("traingate.data_snapshot", ""),
    }


def _register_script_checkpoint(c: MlflowClient, name: str, stage_run_id: str, checkpoint_uri: str) -> ModelVersion:
    """The newest checkpoint file a script declared, logged into the stage run (``checkpoint/<file>``, the
    index beside it under ``checkpoints/``) and registered as a version of ``name`` whose source is that
    artifact directory. The file is the model: traingate does not know how to load it, its user does.

    MLflow 3's ``register_model`` accepts only logged models for a ``runs:/`` URI; a model version whose
    source is a run's artifact directory is created with the client directly (the same record).
    """
    import json
    import tempfile

    from mlflow.exceptions import MlflowException

    from traingate.recipes import script

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
    try:
        c.create_registered_model(name)
    except MlflowException as e:
        # Already there: an earlier version, or another run registering at the same moment. Anything else is not.
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags = {
        **_version_tags(c, stage_run_id),
        "traingate.checkpoint_file": last.path,
        "traingate.checkpoint_sha256": last.sha256,
        "traingate.checkpoint_step": str(last.step or ""),
    }
    return c.create_model_version(name, f"runs:/{stage_run_id}/{SCRIPT_MODEL_PATH}", run_id=stage_run_id, tags=tags)


def _log_final_model(c: MlflowClient, spec: RunSpec, stage_run_id: str, checkpoint_uri: str) -> str:
    import mlflow
    import mlflow.pytorch
    import torch

    model, example = _final_model(spec, checkpoint_uri)
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


# ------------------------------------------------------------------ the alias: compare-and-set
# Several ladders may finish at once. A plain set_registered_model_alias is last-writer-wins: a
# worse model could take `candidate` from a better one, and each run would print a version that
# is already stale. So the alias moves only under a lock shared by every writer of this store,
# and only to a version whose evaluation metric beats the holder's.
EVAL_METRIC = "val_loss"  # every model recipe reports it; lower is better
_METRIC_TAG = f"traingate.{EVAL_METRIC}"


def _eval_metric(c: MlflowClient, stage_run_id: str) -> float | None:
    metrics = c.get_run(stage_run_id).data.metrics
    value = metrics.get(f"stage.{EVAL_METRIC}", metrics.get(EVAL_METRIC))
    return float(value) if value is not None else None


@contextlib.contextmanager
def _alias_lock(c: MlflowClient, name: str) -> Iterator[None]:
    """An exclusive lock for moving ``name``'s aliases: beside a SQLite store, else in the state dir."""
    uri = c.tracking_uri
    base = (
        Path(uri.removeprefix("sqlite:///")).parent
        if uri.startswith("sqlite:///")
        else Settings.from_env().state_dir / "locks"
    )
    base.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(f"{uri}|{name}".encode()).hexdigest()[:16]
    with open(base / f".alias-{digest}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # separate open()s conflict even between threads of one process
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def take_alias_if_better(
    c: MlflowClient, name: str, version: str, stage_run_id: str, alias: str = CANDIDATE
) -> dict[str, Any]:
    """Point ``alias`` at ``version`` if its eval metric beats the current holder's (or there is none).

    The decision and its reason are tagged on the version and on the stage run; the returned
    dict says what holds the alias when the lock is released (``registered``: this version took it).
    """
    mine = _eval_metric(c, stage_run_id)
    if mine is not None:
        c.set_model_version_tag(name, version, _METRIC_TAG, repr(mine))
    with _alias_lock(c, name):
        held = c.get_registered_model(name).aliases.get(alias)
        holder = c.get_model_version(name, held) if held is not None else None
        theirs = holder.tags.get(_METRIC_TAG) if holder is not None else None
        if holder is None:
            won, why = True, f"took @{alias}: no model held it"
        elif str(holder.version) == str(version):  # a retried registration
            won, why = True, f"holds @{alias} already"
        elif mine is None:
            won, why = False, f"@{alias} stays at v{holder.version}: this run logged no {EVAL_METRIC}"
        elif theirs is None or mine < float(theirs):
            won, why = (
                True,
                (
                    f"took @{alias} from v{holder.version}: {EVAL_METRIC} {mine:.6g} < {float(theirs):.6g}"
                    if theirs is not None
                    else f"took @{alias} from v{holder.version}, which has no {EVAL_METRIC}"
                ),
            )
        else:
            won, why = (
                False,
                (
                    f"@{alias} stays at v{holder.version}: its {EVAL_METRIC} {float(theirs):.6g} "
                    f"<= this run's {mine:.6g}"
                ),
            )
        if won:
            c.set_registered_model_alias(name, alias, version)
    c.set_model_version_tag(name, version, "traingate.alias_decision", why)
    c.set_tag(stage_run_id, "traingate.promotion", f"registered {name} v{version}; {why}")
    if not won:
        return {
            "registered": False,
            "name": name,
            "version": version,
            "alias": None,
            "holder_version": holder.version if holder else None,
            "reasons": [f"{name} v{version} registered but not promoted: {why}"],
        }
    c.set_tag(stage_run_id, "traingate.model_uri", f"models:/{name}@{alias}")
    return {
        "registered": True,
        "name": name,
        "version": version,
        "alias": alias,
        "model_uri": f"models:/{name}@{alias}",
        "reason": why,
    }
