"""Registered-model names and their aliases, moved by compare-and-set.

Several ladders may finish at once. A plain set_registered_model_alias is last-writer-wins: a
worse model could take `candidate` from a better one, and each run would print a version that
is already stale. So an alias moves only under a lock shared by every writer of this store
(:func:`alias_lock`), and only to a version whose evaluation metric beats the holder's
(:func:`take_alias_if_better`); :mod:`traingate.promotion.champion` moves ``champion`` under the same lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlflow.entities import Run, RunTag
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from traingate.settings import Settings
from traingate.spec import RunSpec

CANDIDATE = "candidate"


def model_name(spec: RunSpec) -> str:
    return f"{spec.identity.experiment}-{spec.recipe.name}"


EVAL_METRIC = "val_loss"  # every model recipe reports it; lower is better
_METRIC_TAG = f"traingate.{EVAL_METRIC}"


def _eval_metric(c: MlflowClient, stage_run_id: str, run: Run | None) -> float | None:
    metrics = (run if run is not None else c.get_run(stage_run_id)).data.metrics
    value = metrics.get(f"stage.{EVAL_METRIC}", metrics.get(EVAL_METRIC))
    return float(value) if value is not None else None


def alias_holder(c: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    """The version of model ``name`` that ``alias`` points at; None when it points at none or there is no such
    model. One read of that version: the registered model, which lists every version it has, is not read."""
    try:
        return c.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        # The store's answers: INVALID_PARAMETER_VALUE for an alias it does not have, RESOURCE_DOES_NOT_EXIST for
        # a model it does not have.
        if e.error_code in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST"):
            return None
        raise


@contextlib.contextmanager
def alias_lock(c: MlflowClient, name: str) -> Iterator[None]:
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
    c: MlflowClient, name: str, version: str, stage_run_id: str, alias: str = CANDIDATE, run: Run | None = None
) -> dict[str, Any]:
    """Point ``alias`` at ``version`` if its eval metric beats the current holder's (or there is none).

    The decision and its reason are tagged on the version and on the stage run; the returned
    dict says what holds the alias when the lock is released (``registered``: this version took it).
    ``run``: the stage run, read already by the caller (None: read here).
    """
    mine = _eval_metric(c, stage_run_id, run)
    if mine is not None:
        c.set_model_version_tag(name, version, _METRIC_TAG, repr(mine))
    with alias_lock(c, name):
        holder = alias_holder(c, name, alias)
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
    promotion = [RunTag("traingate.promotion", f"registered {name} v{version}; {why}")]
    if won:
        promotion.append(RunTag("traingate.model_uri", f"models:/{name}@{alias}"))
    c.log_batch(stage_run_id, tags=promotion)
    if not won:
        return {
            "registered": False,
            "name": name,
            "version": version,
            "alias": None,
            "holder_version": holder.version if holder else None,
            "reasons": [f"{name} v{version} registered but not promoted: {why}"],
        }
    return {
        "registered": True,
        "name": name,
        "version": version,
        "alias": alias,
        "model_uri": f"models:/{name}@{alias}",
        "reason": why,
    }
