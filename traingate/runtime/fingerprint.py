"""Resume identity: whose checkpoint this is, and whether its state means the same thing to a new process.

A checkpoint is resumed only by the run and stage that wrote it, under a spec with the same
*resume fingerprint*. The fingerprint is not the spec hash: between restarts the OOM policy
legally halves ``optim.batch_size`` and doubles ``optim.grad_accum``, and supervision,
tracking, budget, gates and stage timeouts may change. It covers what the saved weights,
optimizer state, scheduler position and sampler position are only meaningful under:

- ``recipe.name``, ``recipe.params``: what the weights are (the architecture; dropout and the
  like too: a deliberate change goes through ``Checkpointer.init_from``);
- ``data.uri``, ``data.val_fraction``, ``stages.<stage>.max_samples``: the training set the
  sampler's position indexes into (another set or split moves every position);
- ``optim.seed``: the sample permutation of each epoch, and the RNG streams;
- ``optim.lr``, ``optim.weight_decay``: restored from the optimizer state on resume, so a
  changed spec value would silently do nothing;
- ``optim.schedule``, ``optim.warmup_steps``: the shape of the LR curve the saved scheduler
  position lies on.

Left out on purpose: ``optim.batch_size`` and ``grad_accum`` (the OOM policy changes them; the
global batch and the sampler position are unchanged), the world size (resume on a different
world size is supported, see ``traingate/runtime/sampler.py``), ``stages.<stage>.max_steps``
(continuing a checkpoint to a longer horizon is legal: PBT trains each member generation by
generation this way; the LR curve is re-stretched to the new horizon from the saved step on),
``optim.max_grad_norm`` and ``nonfinite_tolerance`` (read afresh every step; no saved state
depends on them), and every non-training section.

>>> from traingate.spec import load_spec_text
>>> text = "identity: {experiment: e, owner: o, team: t, purpose: p}\\nrecipe: {name: digits-cnn}"
>>> a = ResumeIdentity.of("run-1", "full", load_spec_text(text))
>>> b = ResumeIdentity.of("run-1", "full", load_spec_text(text, ["optim.batch_size=8", "optim.grad_accum=4"]))
>>> a.fingerprint == b.fingerprint
True
>>> a.mismatch(ResumeIdentity.of("run-1", "full", load_spec_text(text, ["optim.lr=0.5"])).stamp())
'written under an incompatible spec (optim.lr: 0.5 in the checkpoint, 0.003 now)'
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from traingate.spec import RunSpec


def resume_fields(spec: RunSpec, stage: str) -> dict[str, Any]:
    """The spec values a checkpoint's state depends on (see the module docstring), by dotted name."""
    limits = getattr(spec.stages, stage)
    o = spec.optim
    return {
        "recipe.name": spec.recipe.name,
        "recipe.params": spec.recipe.params,
        "data.uri": spec.data.uri,
        "data.val_fraction": spec.data.val_fraction,
        f"stages.{stage}.max_samples": limits.max_samples,
        "optim.seed": o.seed,
        "optim.lr": o.lr,
        "optim.weight_decay": o.weight_decay,
        "optim.schedule": o.schedule,
        "optim.warmup_steps": o.warmup_steps,
    }


def _canonical(fields: dict[str, Any]) -> dict[str, Any]:
    # Through JSON once, so a value read back from a manifest compares equal to the one computed here.
    return json.loads(json.dumps(fields, sort_keys=True, default=str))


def fingerprint_of(fields: dict[str, Any]) -> str:
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ResumeIdentity:
    """What a resuming process expects of a checkpoint: its run, its stage and its resume fingerprint."""

    run_id: str
    stage: str
    fields: dict[str, Any] = field(compare=False)
    fingerprint: str = ""

    @classmethod
    def of(cls, run_id: str, stage: str, spec: RunSpec) -> ResumeIdentity:
        fields = _canonical(resume_fields(spec, stage))
        return cls(run_id, stage, fields, fingerprint_of(fields))

    def stamp(self) -> dict[str, Any]:
        """The manifest entries that record this identity."""
        return {
            "run_id": self.run_id,
            "stage": self.stage,
            "fingerprint": self.fingerprint,
            "resume_fields": self.fields,
        }

    def mismatch(self, manifest: dict[str, Any]) -> str | None:
        """Why a checkpoint with this manifest is not this identity's to resume (one line), or None."""
        run, stage, fp = manifest.get("run_id"), manifest.get("stage"), manifest.get("fingerprint")
        if run is None or stage is None or fp is None:
            return (
                "it carries no run identity (run id, stage and resume fingerprint): not written by this "
                "version of traingate"
            )
        if run != self.run_id:
            return f"it belongs to run {run!r}, not to this run {self.run_id!r}"
        if stage != self.stage:
            return f"it was written by stage {stage!r} of run {run!r}, not by stage {self.stage!r}"
        if fp == self.fingerprint:
            return None
        saved = manifest.get("resume_fields")
        if isinstance(saved, dict):
            diffs = [
                f"{k}: {json.dumps(saved.get(k))} in the checkpoint, {json.dumps(v)} now"
                for k, v in self.fields.items()
                if saved.get(k) != v
            ]
            diffs += [
                f"{k}: {json.dumps(saved[k])} in the checkpoint, unset now" for k in saved if k not in self.fields
            ]
            if diffs:
                return f"written under an incompatible spec ({'; '.join(diffs)})"
        return f"written under an incompatible spec (resume fingerprint {fp}, {self.fingerprint} now)"
