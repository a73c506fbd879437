"""Scheduled retraining: the ladder on the newest data snapshot, then champion vs challenger.

    newest snapshot -> unchanged since the champion? skip
                    -> ladder to full -> score challenger and champion on the same held-out data
                    -> the challenger takes @champion only if it wins by more than promotion.margin

The ``digits-nightly-retrain`` deployment runs it on a cron; ``traingate retrain SPEC`` runs it here.
"""

from __future__ import annotations

import re
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, Failed, State

from flows.pipeline import flow_settings, ladder, same_end, stopped
from tasks.data import data_snapshot, newest_snapshot
from tasks.retrain import crown_champion, find_champion, score_models
from traingate.promotion.aliases import model_name
from traingate.promotion.champion import CHAMPION, as_dict
from traingate.redact import redact
from traingate.settings import LocationError
from traingate.spec import RunSpec, SpecError


@flow(name="retrain", log_prints=True)
def retrain(spec: RunSpec) -> State:
    """Retrain ``spec`` (its ``data.uri`` may name the version ``{latest}``) and promote only a better model."""
    try:
        flow_settings()
        spec = newest_snapshot(spec)
        snapshot, data_uri = data_snapshot(spec)
    except (LocationError, SpecError) as e:
        return stopped(Failed(message=str(e)), {})
    name = model_name(spec)
    champion = find_champion(spec)
    if champion is not None and champion.data_snapshot == snapshot:
        message = (
            f"skipped: data unchanged since champion v{champion.version} of {name} "
            f"(snapshot {snapshot[:12]}, {redact(data_uri)}); no ladder run"
        )
        _report(name, message, {"champion": as_dict(champion)})
        return Completed(
            message=message,
            data={"skipped": True, "champion": as_dict(champion), "data_snapshot": snapshot, "data_uri": data_uri},
        )
    state = ladder(spec, "full", return_state=True)
    if not state.is_completed():  # a gate refused, or the run stopped: no alias is touched
        return same_end(state)
    summary = state.result()
    assert isinstance(summary, dict), "a completed ladder returns its summary"
    model, full = summary.get("model") or {}, summary["stages"]["full"]
    if not model.get("version"):
        message = (
            f"run {summary['run_id']}: its model was not registered, @{CHAMPION} unchanged: "
            f"{'; '.join(model.get('reasons', [])) or 'no reason recorded'}"
        )
        _report(name, message, {"run_id": summary["run_id"]})
        return stopped(Failed(message=message), summary)
    scores = score_models(spec, full["checkpoint_uri"], champion)
    outcome = crown_champion(spec, model["version"], full["mlflow_run_id"], champion, scores)
    summary["retrain"] = outcome
    verdict = (
        f"{name} v{outcome['version']} took @{CHAMPION}"
        if outcome["promoted"]
        else f"{name} v{outcome['version']} NOT promoted, @{CHAMPION} stays at v{outcome['holder']}"
    )
    message = f"{verdict}: {outcome['reason']} (run {summary['run_id']}, snapshot {snapshot[:12]})"
    get_run_logger().info(message)
    _report(name, message, outcome)
    return Completed(message=message, data=summary)


def _report(name: str, message: str, facts: dict[str, Any]) -> None:
    """The decision as the model's retrain artifact: the latest version of one key per model in the UI."""
    rows = "\n".join(f"| {k} | {redact(str(v))} |" for k, v in facts.items() if v is not None)
    key = "retrain-" + re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    create_markdown_artifact(
        markdown=f"# Retrain of {name}\n\n{redact(message)}\n\n| | |\n|---|---|\n{rows}\n",
        key=key,
        description=f"traingate retrain of {name}: champion/challenger decision",
    )


__all__ = ["retrain"]
