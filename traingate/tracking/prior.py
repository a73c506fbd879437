"""What earlier runs measured, for planning: the latest canary profile of the same recipe."""

from __future__ import annotations

from pathlib import Path

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from traingate.settings import Settings

PROFILE_KEYS = ("step_time_mean_s", "step_time_p99_s", "startup_s")


def latest_canary_profile(settings: Settings, experiment: str, recipe: str) -> dict[str, float] | None:
    """The sizing profile of the newest completed canary of this experiment and recipe, or None.

    Reads only: a missing SQLite store is not created (a dry run must write nothing).
    """
    uri = settings.tracking_uri
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = newest_completed_canary(c, exp.experiment_id, recipe)
    if not runs:
        return None
    m = runs[0].data.metrics
    profile = {k: m[f"stage.{k}"] for k in PROFILE_KEYS if f"stage.{k}" in m}
    return profile if "step_time_mean_s" in profile else None


def newest_completed_canary(c: MlflowClient, experiment_id: str, recipe: str) -> list[Run]:
    """The newest completed canary stage run of ``recipe`` in the experiment (a list of one, or empty)."""
    return c.search_runs(
        [experiment_id],
        "tags.`traingate.stage` = 'canary' and tags.`traingate.stage_status` = 'completed' "
        f"and tags.`traingate.recipe` = '{recipe}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
