"""How many nodes and processes a stage runs with: the one place that decides it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from traingate.spec import RunSpec


def stage_world(spec: RunSpec, stage: str) -> tuple[int, int]:
    """(nodes, processes per node): smoke is one process, canary one node, full the spec's resources.

    >>> from traingate.spec import load_spec_text
    >>> s = load_spec_text("identity: {experiment: e, owner: o, team: t, purpose: p}\\n"
    ...                    "recipe: {name: digits-cnn}\\n"
    ...                    "resources: {nodes: 2, procs_per_node: 2, rdzv_endpoint: 'h:29500'}")
    >>> [stage_world(s, st) for st in ("smoke", "canary", "full")]
    [(1, 1), (1, 2), (2, 2)]
    """
    if stage == "smoke":
        return 1, 1
    if stage == "canary":
        return 1, spec.resources.procs_per_node
    return spec.resources.nodes, spec.resources.procs_per_node
