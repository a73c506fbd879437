"""A pool whose GPUs may be shared, as the replay runs it: requests below one GPU packed, not rounded.

A job that asks for a fraction of a GPU (``Job.milli`` thousandths, e.g. 500) takes that much of one
GPU, beside other fractions; a job of one GPU or more takes wholly free GPUs on one node, and one
wider than a node whole nodes, as on a pool without sharing. A GPU that holds a fraction is not free
for a whole-GPU job until the last fraction on it ends. Where a job goes among the GPUs and nodes
that fit it is the placement (``simulator.placement``): ``bestfit`` or ``fgd``, chosen by
:meth:`traingate.capacity.fill.Cluster.choose`, the same choice and fragmentation measure the fill
experiment uses. The replay keeps each GPU's free thousandths (to give back what an ending job
held) and the fill experiment's ``Cluster`` beside them (nodes grouped by state, for the choice
and for the fragmented capacity: free capacity that no job size of the trace can use).

The scheduling policy is the one of every pool (:func:`traingate.capacity.incremental.plan_pass`):
order, quotas (a fraction counts its thousandths against its team's), backfill on a reservation
that gives back each running job's GPUs in the order of their predicted ends. Preemption frees
whole GPUs and is refused on a trace with fractions (``traingate.capacity.simulate``).

>>> from traingate.capacity.fill import Workload
>>> from traingate.capacity.jobs import Job, started
>>> from traingate.capacity.pools import Placement
>>> run = SharedRunning(nodes=1, gpus_per_node=2, workload=Workload.of([0.5, 1.0]), placement=Placement.BESTFIT)
>>> half = Job("a", "t", "research", "p", 1, 0.0, milli=500)
>>> run.add(started(half, 0.0, run.free.place(1, 500)), 60.0)
>>> run.free.gpus, run.free.total, run.held
([[500, 1000]], 1.5, {'t': 0.5})
>>> run.free.place(2) is None  # the shared GPU is not free for a two-GPU job
True
"""

from __future__ import annotations

from traingate.capacity.fill import MILLI, Cluster, Workload
from traingate.capacity.gang import nodes_needed
from traingate.capacity.incremental import FreeIndex, Running
from traingate.capacity.jobs import Job
from traingate.capacity.pools import Placement


class SharedFreeIndex(FreeIndex):
    """Free capacity per GPU (``gpus``: thousandths), and per node the wholly free GPUs (``free``,
    what a whole-GPU job can take). ``total`` is the free capacity in GPUs, fractions exact."""

    def __init__(self, nodes: int, gpus_per_node: int, workload: Workload, placement: Placement) -> None:
        super().__init__(nodes, gpus_per_node)
        self.placement = placement
        self.cluster = Cluster(nodes, gpus_per_node, workload)
        self.gpus = [[MILLI] * gpus_per_node for _ in range(nodes)]
        self.free_milli = nodes * gpus_per_node * MILLI
        self.total = float(nodes * gpus_per_node)  # GPUs, with fractions
        self.held_by: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]] = {}  # job -> nodes, GPUs, each's share
        # place's answers by size (thousandths) while no GPU changes: a pass asks for the same sizes again and again
        self._answers: dict[int, tuple[int, ...] | None] = {}

    def state(self, node: int) -> tuple[int, ...]:
        return tuple(sorted(self.gpus[node]))

    def place(self, slots: int, milli: int = 0) -> tuple[int, ...] | None:
        if slots > self.gpn:
            return super().place(slots)  # whole nodes, the lowest wholly free ones
        size = milli or slots * MILLI
        if size in self._answers:
            return self._answers[size]
        best = self.cluster.choose(size, self.placement)
        answer = self._answers[size] = None if best is None else (best[2],)
        return answer

    def fits(self, slots: int, milli: int = 0) -> bool:
        return self.place(slots, milli) is not None

    def take(self, slots: int, nodes: tuple[int, ...]) -> None:
        raise AssertionError("a pool with shared GPUs takes a job's GPUs with take_job")

    def release(self, slots: int, nodes: tuple[int, ...]) -> None:
        raise AssertionError("a pool with shared GPUs gives a job's GPUs back with release_job")

    def take_job(self, job: Job) -> None:
        """Take the GPUs of ``job``, placed on ``job.nodes`` (by :meth:`place`): on its node the GPU
        the placement chooses for a fraction, the lowest wholly free GPUs for whole ones."""
        node = job.nodes[0]
        if job.slots > self.gpn:
            self._change(job.nodes, tuple(range(self.gpn)), -MILLI)
            self.held_by[job.job_id] = (job.nodes, tuple(range(self.gpn)), MILLI)
            return
        g = self.gpus[node]
        gpus: tuple[int, ...]
        if job.milli:
            state = self.state(node)
            best = self.cluster.choose(job.milli, self.placement, [(state, (node,))])
            assert best is not None, f"{job.job_id}: {job.milli} thousandths do not fit on node {node}: {g}"
            gpu = g.index(best[3] + job.milli)  # the GPU it went to had its share more than what is left there
            share, gpus = job.milli, (gpu,)
        else:
            gpus = tuple(k for k, f in enumerate(g) if f == MILLI)[: job.slots]
            assert len(gpus) == job.slots, f"{job.job_id}: {job.slots} whole GPUs not free on node {node}: {g}"
            share = MILLI
        self._change((node,), gpus, -share)
        self.held_by[job.job_id] = ((node,), gpus, share)

    def release_job(self, job: Job) -> None:
        nodes, gpus, share = self.held_by.pop(job.job_id)
        self._change(nodes, gpus, share)

    def _change(self, nodes: tuple[int, ...], gpus: tuple[int, ...], delta: int) -> None:
        self._answers.clear()
        for n in nodes:
            g = self.gpus[n]
            before = tuple(sorted(g))
            for k in gpus:
                g[k] += delta
                assert 0 <= g[k] <= MILLI, f"node {n} GPU {k}: {g[k]} thousandths free"
            self.cluster.move(n, before, tuple(sorted(g)))
            self._set(n, g.count(MILLI))
        self.free_milli += delta * len(gpus) * len(nodes)
        self.total = self.free_milli / MILLI

    def fragmented(self, head_slots: int | None) -> float:
        """Free capacity (GPUs) that no job size of the trace can use, whether or not a job waits:
        the fill experiment's measure (``Cluster.fragmented``)."""
        return self.cluster.fragmented / MILLI


class SharedRunning(Running):
    """:class:`Running` on a :class:`SharedFreeIndex`: a team holds its fractions exactly, and a
    reservation gives back each running job's own GPUs."""

    shared = True

    def __init__(self, nodes: int, gpus_per_node: int, workload: Workload, placement: Placement) -> None:
        super().__init__(nodes, gpus_per_node)
        self.free: SharedFreeIndex = SharedFreeIndex(nodes, gpus_per_node, workload, placement)
        self._held_milli: dict[str, int] = {}

    def _share(self, job: Job) -> int:
        """Thousandths of a GPU ``job`` holds: its request, or every GPU of the whole nodes it spans."""
        if job.milli:
            return job.milli
        return (job.slots if job.slots <= self.gpn else nodes_needed(job.slots, self.gpn) * self.gpn) * MILLI

    def _take(self, job: Job) -> None:
        self.free.take_job(job)
        m = self._held_milli[job.team] = self._held_milli.get(job.team, 0) + self._share(job)
        self.held[job.team] = m / MILLI

    def _release(self, job: Job) -> None:
        self.free.release_job(job)
        m = self._held_milli[job.team] = self._held_milli[job.team] - self._share(job)
        self.held[job.team] = m / MILLI

    def _started(self, job_id: str) -> float:
        s = self.jobs[job_id].started_s
        assert s is not None
        return s

    def reserve(self, job: Job, now: float) -> float | None:
        """The earliest predicted end by which ``job`` (which does not fit now) fits: the running jobs
        give back their GPUs in the order of their predicted ends (a job past its prediction, or with
        none, ends at now + the time it has run, as :func:`traingate.capacity.policy.predicted_end`)."""
        late = [(now + (now + e[0]), e[1]) for e in self._late]
        ahead = [(end if end > now else now + (now - self._started(jid)), jid) for end, jid in self._ends]
        gpn = self.gpn
        wide = job.slots > gpn
        k = nodes_needed(job.slots, gpn)
        wholes = self.free.count[gpn]  # wholly free nodes
        size = job.milli or job.slots * MILLI
        freed: dict[int, list[int]] = {}
        for end, jid in sorted(ahead + late):
            nodes, gpus, share = self.free.held_by[jid]
            for n in nodes:
                g = freed.get(n)
                if g is None:
                    g = freed[n] = self.free.gpus[n][:]
                for i in gpus:
                    g[i] += share
                if wide:
                    wholes += g.count(MILLI) == gpn
                    if wholes >= k:
                        return end
                elif (max(g) if job.milli else g.count(MILLI) * MILLI) >= size:
                    return end
        return None
