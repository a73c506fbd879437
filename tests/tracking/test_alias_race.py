"""Concurrent ladders promote through a compare-and-set: `candidate` only ever moves to a better model.

Real MLflow on SQLite; the registrations race in threads released by one barrier.
"""
from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from tracking_helpers import fresh_store, new_run
from traingate.promotion.aliases import CANDIDATE, alias_holder, take_alias_if_better

NAME = "race-model"


def _version(c: MlflowClient, uri: str, val_loss: float) -> tuple[str, str]:
    """A full-stage run that logged ``val_loss``, and a model version registered from it."""
    run_id = new_run(uri, "alias-race")
    c.log_metric(run_id, "stage.val_loss", val_loss)
    v = c.create_model_version(NAME, source=f"{c.get_run(run_id).info.artifact_uri}/model", run_id=run_id)
    return run_id, v.version


def _race(c: MlflowClient, contenders: list[tuple[str, str]]) -> list[dict[str, Any]]:
    barrier = threading.Barrier(len(contenders))
    out: list[dict[str, Any]] = [{} for _ in contenders]

    def go(i: int, run_id: str, version: str) -> None:
        barrier.wait()
        out[i] = take_alias_if_better(c, NAME, version, run_id)
    threads = [threading.Thread(target=go, args=(i, r, v)) for i, (r, v) in enumerate(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_racing_registrations_leave_candidate_on_the_best_model_and_each_reports_the_truth(tmp_path: Path):
    uri = fresh_store(tmp_path / "mlflow.db")
    c = MlflowClient(uri)
    c.create_registered_model(NAME)
    rng = random.Random(10)
    best = float("inf")
    for round_ in range(6):
        losses = [round(rng.uniform(0.1, 1.0), 4), round(rng.uniform(0.1, 1.0), 4)]
        contenders = [_version(c, uri, loss) for loss in losses]
        results = _race(c, contenders)
        best = min(best, *losses)
        holder = c.get_model_version_by_alias(NAME, CANDIDATE)
        assert float(holder.tags["traingate.val_loss"]) == best, (round_, losses, results)
        for (run_id, version), loss, res in zip(contenders, losses, results):
            decision = c.get_model_version(NAME, version).tags["traingate.alias_decision"]
            promotion = c.get_run(run_id).data.tags["traingate.promotion"]
            assert promotion.endswith(decision)
            if res["registered"]:
                # It took the alias; only a strictly better model may have taken it since.
                assert decision.startswith(f"took @{CANDIDATE}")
                assert holder.version == version or float(holder.tags["traingate.val_loss"]) < loss
            else:
                assert decision.startswith(f"@{CANDIDATE} stays at v{res['holder_version']}: its val_loss ")
                held = c.get_model_version(NAME, res["holder_version"])
                assert float(held.tags["traingate.val_loss"]) <= loss
                assert res["reasons"] == [f"{NAME} v{version} registered but not promoted: {decision}"]


def test_a_worse_model_registered_later_does_not_take_candidate(tmp_path: Path):
    uri = fresh_store(tmp_path / "mlflow.db")
    c = MlflowClient(uri)
    c.create_registered_model(NAME)
    good_run, good = _version(c, uri, 0.2)
    bad_run, bad = _version(c, uri, 0.3)
    assert take_alias_if_better(c, NAME, good, good_run)["registered"] is True
    res = take_alias_if_better(c, NAME, bad, bad_run)
    assert res["registered"] is False and res["holder_version"] == good
    assert c.get_model_version_by_alias(NAME, CANDIDATE).version == good
    assert c.get_model_version(NAME, bad).tags["traingate.alias_decision"] == \
        f"@{CANDIDATE} stays at v{good}: its val_loss 0.2 <= this run's 0.3"
    again = take_alias_if_better(c, NAME, good, good_run)  # the registration task retried
    assert again["registered"] is True and again["reason"] == f"holds @{CANDIDATE} already"
    better_run, better = _version(c, uri, 0.1)
    res = take_alias_if_better(c, NAME, better, better_run)
    assert res["registered"] is True and res["reason"] == f"took @{CANDIDATE} from v{good}: val_loss 0.1 < 0.2"
    assert c.get_model_version_by_alias(NAME, CANDIDATE).version == better


def test_an_aliases_holder_is_read_as_one_version_and_none_where_there_is_no_alias_or_no_model(tmp_path: Path):
    uri = fresh_store(tmp_path / "mlflow.db")
    c = MlflowClient(uri)
    assert alias_holder(c, NAME, CANDIDATE) is None  # no such model
    c.create_registered_model(NAME)
    assert alias_holder(c, NAME, CANDIDATE) is None  # a model without the alias
    run_id, version = _version(c, uri, 0.2)
    c.set_model_version_tag(NAME, version, "traingate.val_loss", "0.2")
    c.set_registered_model_alias(NAME, CANDIDATE, version)
    holder = alias_holder(c, NAME, CANDIDATE)
    assert holder is not None and holder.version == version and holder.run_id == run_id
    assert holder.tags["traingate.val_loss"] == "0.2"
