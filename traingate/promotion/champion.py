"""Champion/challenger: a retrained model takes the ``champion`` alias only if it beats the champion.

Both models are scored by the recipe's own ``evaluate`` on the same held-out data (the validation
split of the snapshot the challenger was trained on), so the comparison does not depend on which
data each was validated on when it was trained. The challenger takes the alias only when
``champion_val_loss - challenger_val_loss > promotion.margin``; the alias moves under the registry's
alias lock and only if the champion that was scored still holds it (two retrains finishing together
cannot promote against a stale champion).

>>> decide(2.0, 1.5, 0.1, "3").promote
True
>>> decide(2.0, 1.95, 0.1, "3").reason
'challenger val_loss 1.95 does not beat champion v3 (2) by more than the margin 0.1'
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from typing import Any

import mlflow
import mlflow.pytorch
from mlflow.tracking import MlflowClient

from traingate.promotion.aliases import alias_holder, alias_lock, model_name
from traingate.recipes import get_recipe
from traingate.runtime.checkpoint import Checkpointer
from traingate.settings import Settings, checkpoint_key
from traingate.spec import RunSpec, SpecError, parse_spec
from traingate.tracking.runs import SPEC_ARTIFACT

CHAMPION = "champion"
METRIC = "val_loss"  # every built-in recipe's evaluate reports it; lower is better


@dataclass(frozen=True)
class Champion:
    """The version holding ``champion``: what a retrain compares with and skips against."""

    name: str
    version: str
    stage_run_id: str
    data_snapshot: str


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def find(c: MlflowClient, name: str) -> Champion | None:
    """The version of model ``name`` holding ``champion``, or None (no such model, or no champion yet)."""
    v = alias_holder(c, name, CHAMPION)
    if v is None:
        return None
    return Champion(
        name,
        str(v.version),
        v.run_id or v.tags.get("traingate.stage_run_id", ""),
        v.tags.get("traingate.data_snapshot", ""),
    )


def decide(
    champion_loss: float | None, challenger_loss: float, margin: float, champion_version: str | None
) -> Decision:
    """Whether the challenger takes ``champion``: it must beat the champion by more than ``margin``."""
    if champion_loss is None:
        return Decision(True, f"no champion yet: the challenger takes it ({METRIC} {challenger_loss:.6g})")
    gain = champion_loss - challenger_loss
    if gain > margin:
        return Decision(
            True,
            f"challenger {METRIC} {challenger_loss:.6g} beats champion v{champion_version} "
            f"({champion_loss:.6g}) by {gain:.6g} > margin {margin:g}",
        )
    return Decision(
        False,
        f"challenger {METRIC} {challenger_loss:.6g} does not beat champion v{champion_version} "
        f"({champion_loss:.6g}) by more than the margin {margin:g}",
    )


def _champion_spec(c: MlflowClient, champion: Champion) -> RunSpec:
    """The resolved spec the champion was trained with (its run's identity artifact)."""

    with tempfile.TemporaryDirectory(prefix="tg-champion-") as tmp:
        with open(c.download_artifacts(champion.stage_run_id, SPEC_ARTIFACT, tmp)) as f:
            return parse_spec(json.load(f))


def score(c: MlflowClient, spec: RunSpec, checkpoint_uri: str, champion: Champion | None) -> dict[str, float | None]:
    """``{"challenger": val_loss, "champion": val_loss or None}`` on ``spec``'s held-out split.

    The challenger is the full stage's newest checkpoint; the champion is its registered model. A
    recipe whose inputs depend on the data (char-gpt's vocabulary is the corpus's characters) must
    encode the new snapshot as the champion was trained to read it, or its score would be noise: a
    champion whose vocabulary differs is refused in one line rather than scored.
    """

    recipe = get_recipe(spec)
    _, held_out = recipe.load_data()
    # With the deployment's key: weights changed after training (checksum recomputed) are refused, not promoted.
    ckpt = Checkpointer(checkpoint_uri, async_save=False, key=checkpoint_key(Settings.from_env()))
    step = ckpt.find_latest()
    if step is None:
        raise ValueError(f"no valid checkpoint under {checkpoint_uri}: the full stage left no model to score")
    challenger = recipe.build_model()
    challenger.load_state_dict(ckpt.load(step)["model"])
    batch = spec.optim.batch_size
    out: dict[str, float | None] = {
        "challenger": float(recipe.evaluate(challenger.eval(), held_out, batch)[METRIC]),
        "champion": None,
    }
    if champion is None:
        return out
    mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API is process-global; model loading needs it
    if hasattr(recipe, "vocab"):
        theirs = get_recipe(_champion_spec(c, champion))
        ours_v, theirs_v = recipe.vocab(), theirs.vocab()  # type: ignore[attr-defined]  # hasattr(recipe, "vocab")
        if theirs_v != ours_v:
            raise SpecError(
                f"data.uri = {spec.data.uri!r}: its vocabulary ({len(ours_v)} symbols) differs from "
                f"the one champion v{champion.version} was trained on ({len(theirs_v)}), so it cannot "
                "score the champion; move @champion by hand once the new model is judged"
            )
    model = mlflow.pytorch.load_model(f"models:/{champion.name}/{champion.version}")
    out["champion"] = float(recipe.evaluate(model.eval(), held_out, batch)[METRIC])
    return out


def crown(
    c: MlflowClient,
    spec: RunSpec,
    version: str,
    stage_run_id: str,
    champion: Champion | None,
    scores: dict[str, float | None],
) -> dict[str, Any]:
    """Decide, move ``champion`` to ``version`` if it wins (and the scored champion still holds it), and
    record both scores, the margin and the decision on the challenger's full-stage run and version."""
    name = model_name(spec)
    margin = spec.promotion.margin
    challenger = scores["challenger"]
    assert challenger is not None
    decision = decide(scores["champion"], challenger, margin, champion.version if champion else None)
    promoted = False
    with alias_lock(c, name):
        holder = alias_holder(c, name, CHAMPION)
        held = str(holder.version) if holder is not None else None
        if held == str(version):  # a retried call whose first attempt moved it
            promoted = True
        elif held != (champion.version if champion else None):
            decision = Decision(
                False,
                f"@{CHAMPION} moved to v{held} while this retrain scored against "
                f"v{champion.version if champion else '(none)'}; run the retrain again",
            )
        elif decision.promote:
            c.set_registered_model_alias(name, CHAMPION, str(version))
            promoted = True
    verdict = "promoted" if promoted else "not promoted"
    metrics = {"retrain.challenger_val_loss": challenger, "retrain.margin": margin}
    if scores["champion"] is not None:
        metrics["retrain.champion_val_loss"] = scores["champion"]
    for k, v in metrics.items():
        c.log_metric(stage_run_id, k, float(v))
    tags = {
        "traingate.retrain.decision": verdict,
        "traingate.retrain.reason": decision.reason[:5000],
        "traingate.retrain.champion_version": champion.version if champion else "",
        "traingate.retrain.challenger_version": str(version),
    }
    for k, text in tags.items():
        c.set_tag(stage_run_id, k, text)
    c.set_model_version_tag(name, str(version), "traingate.champion_decision", f"{verdict}: {decision.reason}"[:5000])
    return {
        "name": name,
        "version": str(version),
        "promoted": promoted,
        "decision": verdict,
        "reason": decision.reason,
        "margin": margin,
        "challenger_val_loss": challenger,
        "champion_val_loss": scores["champion"],
        "champion_version": champion.version if champion else None,
        "holder": str(version) if promoted else (champion.version if champion else None),
    }


def as_dict(champion: Champion | None) -> dict[str, str] | None:
    return dataclasses.asdict(champion) if champion is not None else None


__all__ = ["CHAMPION", "Champion", "Decision", "as_dict", "crown", "decide", "find", "score"]
