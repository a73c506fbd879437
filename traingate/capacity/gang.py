"""Nodes and slots. A job takes all of its slots at once or none (gang): a job no wider than a
node runs on one node; a wider one takes whole nodes. Nothing is ever held partially.

>>> place(4, [8, 3, 5], gpus_per_node=8)     # best fit: the fullest node that still fits
(2,)
>>> place(16, [8, 3, 8], gpus_per_node=8)    # two whole free nodes
(0, 2)
>>> place(16, [8, 7, 7], gpus_per_node=8) is None
True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from traingate.capacity.jobs import Job


def nodes_needed(slots: int, gpus_per_node: int) -> int:
    return -(-slots // gpus_per_node)


def footprint(slots: int, gpus_per_node: int) -> int:
    """GPUs a job holds: its slots on one node, or every GPU of the whole nodes it spans."""
    return slots if slots <= gpus_per_node else nodes_needed(slots, gpus_per_node) * gpus_per_node


def place(slots: int, free: Sequence[int], gpus_per_node: int) -> tuple[int, ...] | None:
    """Nodes for a job of ``slots`` given the free GPUs per node, or None when it cannot start now.

    Best fit (the node with the fewest free GPUs that still fits) keeps whole nodes free for
    the gang jobs that need them.
    """
    if slots <= gpus_per_node:
        best = -1
        for i, f in enumerate(free):
            if f >= slots and (best < 0 or f < free[best]):
                best = i
        return (best,) if best >= 0 else None
    k = nodes_needed(slots, gpus_per_node)
    whole = [i for i, f in enumerate(free) if f == gpus_per_node]
    return tuple(whole[:k]) if len(whole) >= k else None


def fits(slots: int, free: Sequence[int], gpus_per_node: int) -> bool:
    """Whether :func:`place` finds nodes, without choosing them (a scan in C, not in Python).

    >>> fits(4, [8, 3, 5], 8), fits(16, [8, 7, 7], 8)
    (True, False)
    """
    if slots <= gpus_per_node:
        return bool(free) and max(free) >= slots
    return free.count(gpus_per_node) >= nodes_needed(slots, gpus_per_node)


def take(free: list[int], slots: int, nodes: tuple[int, ...], gpus_per_node: int) -> None:
    """Mark a placement as used in ``free`` (in place)."""
    if slots <= gpus_per_node:
        free[nodes[0]] -= slots
    else:
        for n in nodes:
            free[n] -= gpus_per_node
    # Only the placement's nodes changed: checking every node made each take cost the pool's size.
    assert all(free[n] >= 0 for n in nodes), f"placement {nodes} of {slots} slots overcommits {free}"


def release(free: list[int], slots: int, nodes: tuple[int, ...], gpus_per_node: int) -> None:
    if slots <= gpus_per_node:
        free[nodes[0]] += slots
    else:
        for n in nodes:
            free[n] += gpus_per_node
    assert all(free[n] <= gpus_per_node for n in nodes), f"release of {nodes} frees more than exists: {free}"


def free_per_node(nodes: int, gpus_per_node: int, running: Iterable[Job]) -> list[int]:
    free = [gpus_per_node] * nodes
    for j in running:
        take(free, j.slots, j.nodes, gpus_per_node)
    return free


def fragmented(free: Sequence[int], head_slots: int | None, gpus_per_node: int) -> int:
    """Free GPUs stranded by fragmentation: enough GPUs are free in total for the job at the head
    of the queue, but not on the nodes it needs (one node, or whole nodes). 0 otherwise, and 0
    when nothing waits: free GPUs that no one asked for are idle, not fragmented.
    """
    total = sum(free)
    if head_slots is None or total < head_slots or place(head_slots, free, gpus_per_node) is not None:
        return 0
    return total
