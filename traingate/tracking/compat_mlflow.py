"""MLflow's private API: the only place traingate reaches past MLflow's public surface.

Written against ``mlflow==3.17.2`` (the pin in pyproject.toml); ``tests/test_compat.py`` fails
when the installed version or the behaviour relied on here changes, so a version bump is
re-checked here and nowhere else. This module runs inside training processes: it imports
nothing and only touches objects it is handed.
"""

from __future__ import annotations

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
