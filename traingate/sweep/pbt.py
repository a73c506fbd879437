"""Population-based training: the exploit/explore step between generations, and the checkpoint copy.

A PBT sweep keeps a population of trials training side by side. Every
``scheduler.pbt_interval`` steps the driver ranks the members by their latest
intermediate value; each member in the bottom ``pbt_quantile`` *exploits* a member of
the top quantile (its latest valid checkpoint is copied into the bottom member's
checkpoint location, manifest last) and *explores* (the top member's hyperparameters,
each numeric one multiplied by a factor from ``pbt_perturb`` and clipped to its range,
categoricals re-drawn with a small probability). The bottom member then resumes from
the copied checkpoint with the new hyperparameters, through the ordinary resume path.

Parameters that shape the model (widths, layer counts) cannot change under a copied
checkpoint; list only what may change in ``sweep.space``-order via ``mutable``.
Optimizer hyperparameters (lr, weight decay) are restored from the copied optimizer
state by the runtime, so perturbing them needs the runtime to prefer the spec's values on
resume: that is the open second step; model-side parameters (dropout) work today.

>>> import random
>>> from traingate.sweepspec import ParamSpec
>>> space = {"recipe.params.dropout": ParamSpec(type="float", low=0.0, high=0.5)}
>>> ms = [Member("a", {"recipe.params.dropout": 0.1}, 0.9), Member("b", {"recipe.params.dropout": 0.4}, 0.5)]
>>> [(e.dst, e.src) for e in plan_generation(ms, space, 0.5, [0.8, 1.2], "maximize", random.Random(0))]
[('b', 'a')]
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traingate.runtime.checkpoint import Checkpointer
from traingate.settings import Settings, checkpoint_key
from traingate.sweepspec import ParamSpec

if TYPE_CHECKING:
    from traingate.spec import RunSpec

RESAMPLE_P = 0.25  # chance a categorical is re-drawn when exploring


@dataclass
class Member:
    key: str  # the trial key: names its stage dir and checkpoint location
    params: dict[str, Any]
    score: float | None  # latest intermediate value (None: has not reported yet)


@dataclass
class Exploit:
    dst: str  # bottom member that is overwritten
    src: str  # top member it copies
    params: dict[str, Any]  # src's hyperparameters, perturbed


def perturb(
    params: dict[str, Any],
    space: dict[str, ParamSpec],
    factors: list[float],
    rng: random.Random,
    mutable: set[str] | None = None,
) -> dict[str, Any]:
    out = dict(params)
    for name, value in params.items():
        p = space.get(name)
        if p is None or (mutable is not None and name not in mutable):
            continue
        if p.type == "categorical":
            if rng.random() < RESAMPLE_P:
                assert p.choices is not None, "a categorical parameter has choices (ParamSpec validates it)"
                out[name] = rng.choice(p.choices)
            continue
        v = min(max(value * rng.choice(factors), p.low), p.high)
        out[name] = int(round(v)) if p.type == "int" else float(v)
    return out


def plan_generation(
    members: list[Member],
    space: dict[str, ParamSpec],
    quantile: float,
    factors: list[float],
    direction: str,
    rng: random.Random,
    mutable: set[str] | None = None,
) -> list[Exploit]:
    """Which bottom members copy which top members, with what new hyperparameters."""
    scored = [m for m in members if m.score is not None and math.isfinite(m.score)]
    n = int(len(scored) * quantile)
    if n < 1:
        return []
    sign = -1.0 if direction == "maximize" else 1.0
    order = sorted(scored, key=lambda m: sign * (m.score if m.score is not None else math.nan))
    top, bottom = order[:n], order[-n:]
    plans = []
    for m in bottom:
        src = rng.choice(top)
        plans.append(Exploit(dst=m.key, src=src.key, params=perturb(src.params, space, factors, rng, mutable)))
    return plans


def copy_checkpoint(src_uri: str, dst_uri: str, identity: tuple[str, str, RunSpec] | None = None) -> int:
    """Copy the newest valid checkpoint under ``src_uri`` to ``dst_uri`` (manifest last); return its step.

    A deliberate warm start (``Checkpointer.init_from``): the source is verified as a resume
    would verify it, newer checkpoints at the destination are removed first (so its latest is
    the copy), and the copy is stamped for the destination member: ``identity`` is its
    (run id, stage, spec). Without it the copy is unclaimed, and the member's next run takes it over.
    """
    run_id, stage, spec = identity if identity is not None else (None, None, None)
    key = checkpoint_key(Settings.from_env())  # the members' own checkpoints are signed with it
    return Checkpointer(dst_uri, async_save=False, run_id=run_id, stage=stage, spec=spec, key=key).init_from(src_uri)


def run_generations(
    members: list[Member],
    space: dict[str, ParamSpec],
    quantile: float,
    factors: list[float],
    direction: str,
    generations: int,
    interval: int,
    train: Callable[[Member, int], float],
    checkpoint_uri: Callable[[str], str],
    rng: random.Random,
    mutable: set[str] | None = None,
) -> list[list[Exploit]]:
    """The PBT loop: each generation trains every member to ``g * interval`` steps (resuming its own
    checkpoint) and scores it; between generations the bottom members exploit and explore.

    ``train(member, until_step) -> score`` runs one member's stage (a process tree under a
    trial's slots in a flow, or in-process); returns the exploits of each generation.
    """
    by_key = {m.key: m for m in members}
    history = []
    for g in range(1, generations + 1):
        for m in members:
            m.score = train(m, g * interval)
        if g == generations:
            break
        plans = plan_generation(members, space, quantile, factors, direction, rng, mutable)
        for e in plans:
            copy_checkpoint(checkpoint_uri(e.src), checkpoint_uri(e.dst))
            by_key[e.dst].params = e.params
        history.append(plans)
    return history
