"""Registry boundary of the retrain flow: read the champion, score it against the challenger, crown one."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from traingate.promotion import champion as ch
from traingate.promotion.aliases import model_name
from traingate.settings import Settings
from traingate.spec import RunSpec
from traingate.tracking import runs


def _client():
    return runs.client(Settings.from_env().tracking_uri)


@task(name="find-champion", cache_policy=NONE, retries=2, retry_delay_seconds=[1, 5])
def find_champion(spec: RunSpec) -> ch.Champion | None:
    return ch.find(_client(), model_name(spec))


@task(name="score-challenger-and-champion", cache_policy=NONE)
def score_models(spec: RunSpec, checkpoint_uri: str, champion: ch.Champion | None) -> dict[str, float | None]:
    """Both models on the new snapshot's held-out split (loads models and data: not retried)."""
    return ch.score(_client(), spec, checkpoint_uri, champion)


# Retried: a second attempt finds the alias it moved and records the same values again.
@task(name="crown-champion", cache_policy=NONE, retries=2, retry_delay_seconds=[1, 5])
def crown_champion(
    spec: RunSpec, version: str, stage_run_id: str, champion: ch.Champion | None, scores: dict[str, float | None]
) -> dict[str, Any]:
    return ch.crown(_client(), spec, version, stage_run_id, champion, scores)
