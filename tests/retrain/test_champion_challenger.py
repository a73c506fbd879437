"""The retrain flow on real ladders (Prefect test harness, MLflow sqlite, torchrun): the first retrain takes
@champion; a worse model on a new snapshot does not, a better one does; unchanged data is skipped."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from traingate.settings import Settings
from traingate.spec import load_spec_text

from retrain_data import publish, tiny_chargpt

pytestmark = pytest.mark.slow

MODEL = "retrain-tests-char-gpt"


def _runs(c: MlflowClient) -> list:
    exp = c.get_experiment_by_name("retrain-tests")
    return c.search_runs([exp.experiment_id]) if exp else []


def _champion(c: MlflowClient) -> str:
    return str(c.get_registered_model(MODEL).aliases["champion"])


@pytest.mark.timeout(900)
def test_a_worse_model_is_not_promoted_a_better_one_is_and_unchanged_data_is_skipped(prefect_harness, state_dir,
                                                                                     tmp_path):
    from prefect.artifacts import Artifact

    from flows.retrain import retrain

    corpus = tmp_path / "corpus"
    spec_text = tiny_chargpt(f"{corpus.as_uri()}/{{latest}}/input.txt")
    c = MlflowClient(Settings.from_env().tracking_uri)

    # 1. No champion yet: the first retrain's model takes it.
    publish(corpus, "2026-11-20", seed=1)
    first = retrain(load_spec_text(spec_text), return_state=True)
    assert first.is_completed(), first.message
    assert first.message.startswith(f"{MODEL} v1 took @champion: no champion yet"), first.message
    assert _champion(c) == "1"
    full = c.get_run(first.result()["stages"]["full"]["mlflow_run_id"])
    assert full.data.tags["traingate.data_uri"] == f"{corpus.as_uri()}/2026-11-20/input.txt"  # the identity's
    assert full.data.tags["traingate.retrain.decision"] == "promoted"

    # 2. The same snapshot again: skipped, Completed, no ladder and no new MLflow run.
    before = len(_runs(c))
    snapshot = full.data.tags["traingate.data_snapshot"]
    skipped = retrain(load_spec_text(spec_text), return_state=True)
    assert skipped.is_completed()
    assert skipped.message.startswith(f"skipped: data unchanged since champion v1 of {MODEL} "
                                      f"(snapshot {snapshot[:12]}, "), skipped.message
    assert len(_runs(c)) == before

    # 3. A new snapshot, but a crippled run (2 full steps): scored worse on the same held-out data, not promoted.
    publish(corpus, "2026-11-21", seed=2)
    worse = retrain(load_spec_text(spec_text, ["stages.full.max_steps=2"]), return_state=True)
    assert worse.is_completed(), worse.message
    out = worse.result()["retrain"]
    assert not out["promoted"] and out["champion_version"] == "1" and out["version"] == "2"
    assert out["champion_val_loss"] < out["challenger_val_loss"]
    assert worse.message.startswith(f"{MODEL} v2 NOT promoted, @champion stays at v1: challenger val_loss "), \
        worse.message
    assert _champion(c) == "1"
    run = c.get_run(worse.result()["stages"]["full"]["mlflow_run_id"])
    assert run.data.metrics["retrain.champion_val_loss"] == pytest.approx(out["champion_val_loss"])
    assert run.data.metrics["retrain.challenger_val_loss"] == pytest.approx(out["challenger_val_loss"])
    assert run.data.metrics["retrain.margin"] == 0.0
    assert (run.data.tags["traingate.retrain.decision"], run.data.tags["traingate.retrain.champion_version"]) == \
        ("not promoted", "1")
    artifact = Artifact.get("retrain-retrain-tests-char-gpt")
    assert artifact is not None and "v2 NOT promoted" in artifact.data and "champion_val_loss" in artifact.data

    # 4. A newer snapshot, trained longer: better than the champion by more than the margin, promoted.
    publish(corpus, "2026-11-22", seed=3)
    better = retrain(load_spec_text(spec_text, ["stages.full.max_steps=120", "promotion.margin=0.01"]),
                     return_state=True)
    assert better.is_completed(), better.message
    out = better.result()["retrain"]
    assert out["promoted"] and out["champion_version"] == "1" and out["version"] == "3", out
    assert out["champion_val_loss"] - out["challenger_val_loss"] > 0.01
    assert better.message.startswith(f"{MODEL} v3 took @champion: challenger val_loss "), better.message
    assert _champion(c) == "3"
    run = c.get_run(better.result()["stages"]["full"]["mlflow_run_id"])
    assert run.data.tags["traingate.retrain.decision"] == "promoted"
    assert run.data.tags["traingate.data_uri"] == f"{corpus.as_uri()}/2026-11-22/input.txt"
    assert c.get_model_version(MODEL, "3").tags["traingate.champion_decision"].startswith("promoted: ")


@pytest.mark.timeout(600)
def test_a_retrain_whose_ladder_fails_a_gate_ends_failed_and_moves_no_alias(prefect_harness, state_dir, tmp_path):
    from flows.retrain import retrain

    corpus = tmp_path / "corpus"
    publish(corpus, "2026-11-20", seed=1)
    spec = load_spec_text(tiny_chargpt(f"{corpus.as_uri()}/{{latest}}/input.txt", experiment="retrain-gate"),
                          ["optim.lr=0"])  # the canary's loss does not fall
    state = retrain(spec, return_state=True)
    assert state.is_failed()
    assert state.message.startswith("gate after canary: FAILED: loss_decrease_fraction"), state.message
    c = MlflowClient(Settings.from_env().tracking_uri)
    assert c.search_registered_models("name = 'retrain-gate-char-gpt'") == []
