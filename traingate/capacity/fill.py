"""The fill experiment of the GPU-sharing literature, with shared GPUs and two placement policies.

Jobs sampled from a trace (each of its jobs equally likely, with replacement) arrive one after
another and stay; each is placed at once or not at all. After each arrival the experiment records
the arrived demand (GPUs asked so far, as a share of the pool's capacity), the share of GPUs left
unallocated and the share *fragmented*: free GPU capacity that no job size of the trace can use (a
0.25 GPU left on a GPU when the smallest request is 0.5; free GPUs on a node that no whole-GPU job
fits and no fraction asks for). Arrivals go on until the arrived demand reaches the capacity; the
arrived demand at which the first job found no room is reported too.

Requests below one GPU share a GPU: a 0.5 request takes half of one GPU, and two of them fill it.
Requests of one GPU or more are whole GPUs on one node; wider than a node, whole nodes (as the
replay's gang placement has them). Shares are counted in thousandths of a GPU (``MILLI``).

Placement policies (``Placement``):

- ``bestfit``: the GPU (fractional requests) or node (whole GPUs) that keeps the least free
  capacity after the placement; ties to the node with less free capacity, then the lower index.
- ``fgd``: fragmentation gradient descent (Weng et al., "Beware of Fragmentation: Scheduling
  GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC'23): a node's
  fragmentation is the free capacity a job cannot use, averaged over the workload's job sizes by
  their frequency in the trace; a job goes where that expected fragmentation grows least. Ties as
  ``bestfit``.

>>> cluster = Cluster(nodes=1, gpus_per_node=2, workload=Workload.of([0.5, 1.0]))
>>> cluster.place(500, Placement.BESTFIT), cluster.place(500, Placement.BESTFIT), cluster.place(1000, Placement.BESTFIT)
(True, True, True)
>>> cluster.allocated, cluster.place(500, Placement.BESTFIT)
(2000, False)
"""

from __future__ import annotations

from bisect import insort
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traingate.capacity.pools import CapacityError, Placement

MILLI = 1000  # a GPU in thousandths: shared requests are packed in these units
DEFAULT_RUNS = 5
LEVELS = 100  # the fill curve's points: arrived demand 1%, 2%, ... 100% of capacity


def parse_placements(text: str) -> list[Placement]:
    """``bestfit,fgd`` -> the placements; one CapacityError line for a name that is not one."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise CapacityError(f"--placements {text!r} is empty; name one or more of {', '.join(Placement)}")
    for n in names:
        if n not in {p.value for p in Placement}:
            raise CapacityError(f"--placements: {n!r} is not a placement policy; use {', '.join(Placement)}")
    return [Placement(n) for n in dict.fromkeys(names)]


def to_milli(gpus: float) -> int:
    """A request in thousandths of a GPU (a share below one GPU is at least one thousandth)."""
    return max(1, round(gpus * MILLI)) if gpus < 1 else round(gpus) * MILLI


@dataclass(frozen=True)
class Workload:
    """The job sizes of a trace (thousandths of a GPU) and how often each occurs."""

    sizes: tuple[int, ...]
    weights: tuple[float, ...]

    @classmethod
    def of(cls, requests: Sequence[float]) -> Workload:
        counts = Counter(to_milli(g) for g in requests)
        sizes = sorted(counts)
        return cls(tuple(sizes), tuple(counts[s] / len(requests) for s in sizes))


State = tuple[int, ...]  # a node's free thousandths per GPU, ascending (its GPUs are interchangeable)


def unusable(state: State, size: int) -> int:
    """Free capacity on a node that a job of ``size`` cannot use (FGD's fragment of a node for one job):
    below a GPU, the GPUs with less free than it asks; whole GPUs, the partly used GPUs when enough
    GPUs are wholly free, else all; wider than the node, all unless the node is wholly free."""
    total = sum(state)
    if size < MILLI:
        return sum(f for f in state if f < size)
    if size > MILLI * len(state):
        return 0 if total == MILLI * len(state) else total
    whole = sum(f == MILLI for f in state)
    return total - whole * MILLI if whole * MILLI >= size else total


class Cluster:
    """One pool's nodes as GPU states, grouped: nodes in the same state are interchangeable but for
    their index, so a placement looks at each distinct state once."""

    def __init__(self, nodes: int, gpus_per_node: int, workload: Workload) -> None:
        self.gpn = gpus_per_node
        self.workload = workload
        self.capacity = nodes * gpus_per_node * MILLI
        self.allocated = 0
        self._nodes: dict[State, list[int]] = {(MILLI,) * gpus_per_node: list(range(nodes))}
        self._expected: dict[State, float] = {}
        self._stranded: dict[State, int] = {}
        self._candidates: dict[tuple[State, int], list[tuple[State, int]]] = {}
        self.fragmented = 0  # free capacity no job size of the workload can use

    def expected_fragmentation(self, state: State) -> float:
        """FGD's node fragmentation: :func:`unusable` averaged over the workload's job sizes."""
        v = self._expected.get(state)
        if v is None:
            v = self._expected[state] = sum(
                w * unusable(state, s) for s, w in zip(self.workload.sizes, self.workload.weights)
            )
        return v

    def stranded(self, state: State) -> int:
        """Free capacity on a node that no job size of the workload can use."""
        v = self._stranded.get(state)
        if v is None:
            v = self._stranded[state] = min(unusable(state, s) for s in self.workload.sizes)
        return v

    def place(self, size: int, policy: Placement) -> bool:
        """Place a job of ``size`` thousandths; False (nothing changed) when it fits nowhere."""
        if size > MILLI * self.gpn:
            return self._place_whole_nodes(size)
        best = self.choose(size, policy)
        if best is None:
            return False
        state, after, node, _ = best
        self.move(node, state, after)
        self.allocated += size
        return True

    def choose(
        self, size: int, policy: Placement, among: Iterable[tuple[State, Sequence[int]]] | None = None
    ) -> tuple[State, State, int, int] | None:
        """Where a job of ``size`` thousandths (at most a node) goes: the node's state, the state it
        becomes, the node (the lowest of those in that state) and what is left where it went (free on
        the GPU it shares, or wholly free GPUs on the node); None when it fits nowhere. ``among``:
        (state, nodes in it) to choose from, every node by default."""
        best: tuple[tuple[float, ...], State, State, int, int] | None = None
        for state, idx in self._nodes.items() if among is None else among:
            cands = self._candidates.get((state, size))
            if cands is None:
                cands = self._candidates[state, size] = _candidates(state, size)
            for after, left in cands:
                # Best fit: the least free left on the GPU shared (fractions) or the node, then the node's free.
                tight = (left, sum(after), idx[0])
                if policy is Placement.FGD:
                    score: tuple[float, ...] = (
                        self.expected_fragmentation(after) - self.expected_fragmentation(state),
                        *tight,
                    )
                else:
                    score = tight
                if best is None or score < best[0]:
                    best = (score, state, after, idx[0], left)
        return None if best is None else best[1:]

    def _place_whole_nodes(self, size: int) -> bool:
        k = -(-size // (MILLI * self.gpn))
        free = self._nodes.get((MILLI,) * self.gpn, [])
        if len(free) < k:
            return False
        for node in free[:k]:
            self.move(node, (MILLI,) * self.gpn, (0,) * self.gpn)
        self.allocated += k * self.gpn * MILLI  # the whole nodes are held, as the replay's footprint has it
        return True

    def move(self, node: int, state: State, after: State) -> None:
        """Node ``node`` goes from ``state`` to ``after`` (its fragmentation counted again)."""
        idx = self._nodes[state]
        idx.remove(node)
        if not idx:
            del self._nodes[state]
        insort(self._nodes.setdefault(after, []), node)
        self.fragmented += self.stranded(after) - self.stranded(state)


def _candidates(state: State, size: int) -> list[tuple[State, int]]:
    """The states ``state`` can become by placing a job of ``size`` (at most a node wide), each with
    what is left where it went: on the GPU it shares (below a GPU), or wholly free GPUs on the node."""
    if size < MILLI:
        out = []
        for k, f in enumerate(state):
            if f >= size and (k == 0 or state[k - 1] != f):  # one GPU per distinct free amount
                out.append((tuple(sorted((*state[:k], f - size, *state[k + 1 :]))), f - size))
        return out
    need = size // MILLI
    whole = sum(f == MILLI for f in state)
    if whole < need:
        return []
    # The wholly free GPUs sort last: the job takes ``need`` of them.
    return [(tuple(sorted((*state[: len(state) - need], *(0 for _ in range(need))))), whole - need)]


@dataclass(frozen=True)
class FillCurve:
    """One placement policy's fill experiment on one pool, averaged over runs at each level."""

    pool: str
    placement: Placement
    levels: np.ndarray  # arrived demand as a share of capacity: 0.01 ... 1.0
    unallocated: np.ndarray  # share of capacity unallocated at that level
    fragmented: np.ndarray  # share of capacity free and usable by no job size
    failed_jobs: np.ndarray  # jobs that found no room, up to that level (mean over runs)
    first_failure: float  # mean arrived demand when the first job found no room (1.0: none did)
    runs: int


def fill(
    pool: str,
    nodes: int,
    gpus_per_node: int,
    requests: Sequence[float],
    placement: Placement,
    runs: int = DEFAULT_RUNS,
    seed: int = 0,
) -> FillCurve:
    """The fill experiment: ``runs`` times, jobs drawn from ``requests`` (GPUs, fractions below 1)
    arrive until their demand reaches the capacity. Run ``k`` draws with seed ``seed + k``, the same
    jobs for every placement policy."""
    if runs < 1:
        raise CapacityError(f"--fill-runs = {runs}: must be at least 1")
    if not requests:
        raise CapacityError(f"pool {pool!r}: no jobs to fill it with; add trace rows that accept it")
    workload = Workload.of(requests)
    levels = np.arange(1, LEVELS + 1) / LEVELS
    unalloc = np.zeros(LEVELS)
    frag = np.zeros(LEVELS)
    failed = np.zeros(LEVELS)
    first = 0.0
    milli = np.array([to_milli(g) for g in requests])
    for k in range(runs):
        cluster = Cluster(nodes, gpus_per_node, workload)
        rng = np.random.default_rng(seed + k)
        arrived = 0
        fails = 0
        first_k: float | None = None
        level = 0  # levels[:level] are recorded
        while level < LEVELS:
            size = int(milli[rng.integers(len(milli))])
            # Record every level this arrival passes, as the state just before it.
            while level < LEVELS and arrived + size > levels[level] * cluster.capacity:
                unalloc[level] += 1 - cluster.allocated / cluster.capacity
                frag[level] += cluster.fragmented / cluster.capacity
                failed[level] += fails
                level += 1
            if level == LEVELS:
                break  # it would take the demand past the capacity: the experiment ends before it
            if not cluster.place(size, placement):
                fails += 1
                if first_k is None:
                    first_k = arrived / cluster.capacity
            arrived += size
        first += 1.0 if first_k is None else first_k
    return FillCurve(pool, placement, levels, unalloc / runs, frag / runs, failed / runs, first / runs, runs)


TABLE_LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def fill_table(curves: Sequence[FillCurve]) -> str:
    """Markdown: per pool and placement, the unallocated and fragmented shares at fill levels."""
    head = " | ".join(f"{x:.0%}" for x in TABLE_LEVELS)
    lines = [
        f"| pool | placement | share | {head} | first job without room at |",
        "|---|---|---|" + "---|" * len(TABLE_LEVELS) + "---|",
    ]
    for c in curves:
        at = [int(round(x * LEVELS)) - 1 for x in TABLE_LEVELS]
        for name, ys in (("unallocated", c.unallocated), ("fragmented", c.fragmented)):
            cells = " | ".join(f"{ys[i]:.1%}" for i in at)
            tail = f"{c.first_failure:.1%} arrived" if name == "unallocated" else ""
            lines.append(f"| {c.pool} | {c.placement} | {name} | {cells} | {tail} |")
    return "\n".join(lines) + "\n"


FILL_COLUMNS = "pool,placement,arrived,unallocated,fragmented,failed_jobs,runs"


def write_fill(curves: Sequence[FillCurve], path: Path) -> Path:
    """Every level of every curve, every digit."""

    def num(x: float) -> str:
        return str(np.format_float_positional(float(x), trim="0"))

    with path.open("w", encoding="utf-8") as f:
        f.write(FILL_COLUMNS + "\n")
        for c in curves:
            for i in range(len(c.levels)):
                f.write(
                    f"{c.pool},{c.placement},{num(c.levels[i])},{num(c.unallocated[i])},"
                    f"{num(c.fragmented[i])},{num(c.failed_jobs[i])},{c.runs}\n"
                )
    return path
