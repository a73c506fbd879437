"""Data boundary: find the newest snapshot, and read the dataset once to fingerprint it for the run's identity."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from traingate.recipes import get_recipe
from traingate.secrets import resolve
from traingate.snapshots import resolve_spec
from traingate.spec import RunSpec
from traingate.tracking.identity import hash_file_uri


@task(name="newest-snapshot", cache_policy=NONE)
def newest_snapshot(spec: RunSpec) -> RunSpec:
    """``spec`` with a ``{latest}`` in ``data.uri`` resolved to the newest version (traingate.snapshots)."""
    return resolve_spec(spec)


@task(name="data-snapshot", cache_policy=NONE)
def data_snapshot(spec: RunSpec) -> tuple[str, str]:
    """(content hash, uri) of the data the run trains on."""
    if spec.recipe.name == "script":
        if spec.data.uri is None:
            return "undeclared", "undeclared"
        return hash_file_uri(resolve(spec.data.uri, field="data.uri")), spec.data.uri
    recipe = get_recipe(spec)
    return recipe.data_snapshot(), recipe.data_uri()
