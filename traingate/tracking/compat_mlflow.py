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
