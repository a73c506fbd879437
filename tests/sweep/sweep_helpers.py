"""Sweep test helpers (import as `from sweep_helpers import ...`): a tiny digits spec with a sweep section,
and readers for what a sweep left behind."""
from __future__ import annotations

import textwrap

import optuna
import pytest

SWEEP_BASE = """
sweep:
  space:
    optim.lr: {type: float, low: 0.002, high: 0.05, log: true}
    recipe.params.hidden: {type: categorical, choices: [8, 16]}
  sampler: random
  seed: 3
  stage: canary
  heartbeat_s: 1
  grace_s: 4
"""

# Trials run one process each (no torchrun) on the smallest digits net.
ONE_PROC = ["resources.procs_per_node=1", "recipe.params.channels=4"]


@pytest.fixture
def sweep_spec(tiny_spec):
    """A tiny digits spec whose sweep section is SWEEP_BASE plus ``extra`` (indented under sweep:)."""
    def make(extra: str = "", name: str = "sweep.yaml"):
        body = SWEEP_BASE + textwrap.indent(textwrap.dedent(extra), "  ")
        return tiny_spec(body, name=name)
    return make


def load(spec_path, overrides, storage):
    from traingate.spec import load_spec
    from traingate.sweep.study import study_name

    spec = load_spec(spec_path, overrides)
    return optuna.load_study(study_name=study_name(spec), storage=storage)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of [start, end) intervals that hold at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best
