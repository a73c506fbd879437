"""MLflow's private API: the only place traingate reaches past MLflow's public surface.

Written against ``mlflow==3.17.2`` (the pin in pyproject.toml); ``tests/test_compat.py`` fails
when the installed version or the behaviour relied on here changes, so a version bump is
re-checked here and nowhere else. This module runs inside training processes: it imports
nothing and only touches objects it is handed.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.entities import Metric, Run
    from mlflow.tracking import MlflowClient
    from sqlalchemy.engine import Engine

PINNED = "3.17.2"


def latest_metrics(run: Run) -> list[Metric]:
    """Each metric key's latest record *with its step* (``run.data.metrics`` keeps only the values).

    A resumed training process needs the step each key reached; the public alternative is one
    ``get_metric_history`` request per key.
    """
    return list(run.data._metric_objs)  # noqa: SLF001


def cache_schema_head(db_utils: ModuleType) -> str:
    """``mlflow.store.db.utils`` (handed in) with its newest schema revision computed once and kept; returns it.

    Every SQL store MLflow opens compares its database's revision with the newest of MLflow's migration scripts
    (``_get_latest_schema_revision``: the scripts read again, 10-12 ms a store). That revision depends on the
    installed MLflow alone, so a process that forks commands computes it once and its children inherit it; each
    child still reads its own database's revision and refuses one that differs.
    """
    latest = db_utils._get_latest_schema_revision  # noqa: SLF001
    if not hasattr(latest, "cache_info"):
        latest = db_utils._get_latest_schema_revision = functools.cache(latest)  # type: ignore[attr-defined]  # noqa: SLF001
    return str(latest())


def sql_engines(client: MlflowClient) -> list[Engine]:
    """The SQLAlchemy engines of ``client``'s tracking and model registry stores (those that are SQL stores).

    MLflow keeps one store per URI in each process and one engine per database URI; the stores are reached
    through the client's private service clients.
    """
    stores = [client._tracking_client.store, client._get_registry_client().store]  # noqa: SLF001
    return [store.engine for store in stores if hasattr(store, "engine")]


def forget_stores(tracking: ModuleType) -> None:
    """``mlflow.tracking`` (handed in) with its per-URI tracking and model registry stores forgotten: the next
    client opens its stores anew (their database's tables and schema revision checked again). The SQL engines
    stay (one per database URI): they make new connections."""
    for registry in (
        tracking._tracking_service.registry.TrackingStoreRegistry,  # noqa: SLF001
        tracking._model_registry.registry.ModelRegistryStoreRegistry,  # noqa: SLF001
    ):
        registry._get_store_with_resolved_uri.cache_clear()  # noqa: SLF001
