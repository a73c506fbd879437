"""The pass of :func:`traingate.capacity.policy.schedule` over state kept from pass to pass.

``schedule`` rebuilds everything from plain lists: free GPUs from every running job, the queue
sorted and predicted whole, a reservation from every running job sorted by predicted end. That
is right for the local engine (a handful of jobs) and too slow to replay a cluster of hundreds of
nodes and a queue of thousands through it event after event. The simulator keeps instead:

- ``FreeIndex``: free GPUs per node, with the nodes indexed by their free count, so best fit is
  a look-up per count, not a scan of the nodes;
- ``Running``: the running jobs with their predictions fixed when they start (as a Slurm job's
  end is fixed by its time limit), sorted by predicted end, so a reservation walks only the
  jobs that end before it;
- ``Queue``: the waiting jobs in groups that the policy always serves in submission order and
  decides alike (same class, team and size, first attempt, no estimate of their own), one pass
  merging the groups' first jobs in the policy's order. When a group's first job cannot start,
  none behind it can (nothing a pass does frees slots or quota, except a preemption, after
  which the groups are looked at again), so a pass visits a group once, not each of its jobs.

:func:`plan_pass` then makes the same decisions as ``schedule`` in the same order; a test
replays traces through both and compares every attempt. A pass at which nothing started since the
last one (arrivals, and job ends whose freed GPUs and moved predictions it is told of) looks again
only at what may decide otherwise (see ``Settled``); a pass ends once nothing behind the head fits
and no job may preempt; a reservation is kept while the jobs that start are predicted to end by it.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Mapping
from operator import itemgetter
from typing import Any

from traingate.capacity.estimate import Predictor
from traingate.capacity.fill import MILLI
from traingate.capacity.gang import footprint, nodes_needed
from traingate.capacity.jobs import Job, started
from traingate.capacity.policy import How, Order, Plan, Rules, Start, choose_victims, order_key, schedule
from traingate.capacity.pools import PoolConfig, PriorityClass


class FreeIndex:
    """Free GPUs per node (``free``), their sum, and the nodes by free count (lazy heaps)."""

    def __init__(self, nodes: int, gpus_per_node: int) -> None:
        self.gpn = gpus_per_node
        self.free = [gpus_per_node] * nodes
        self.total: float = nodes * gpus_per_node  # whole GPUs here; with fractions in SharedFreeIndex
        self.count = [0] * (gpus_per_node + 1)
        self.count[gpus_per_node] = nodes
        # by_free[f]: node indices that had f free when pushed; an entry whose node no longer has f is stale.
        # by_free[0] stays empty.
        self.by_free: list[list[int]] = [[] for _ in range(gpus_per_node + 1)]
        self.by_free[gpus_per_node] = list(range(nodes))
        self.top = gpus_per_node if nodes else 0  # the most free GPUs on one node: a job of s <= top fits

    def _set(self, node: int, f: int) -> None:
        old = self.free[node]
        assert 0 <= f <= self.gpn, f"node {node}: {f} free of {self.gpn}"
        count = self.count
        count[old] -= 1
        count[f] += 1
        self.free[node] = f
        if f > self.top:
            self.top = f
        elif old == self.top and not count[old]:
            t = old
            while t and not count[t]:
                t -= 1
            self.top = t
        if not f:  # a full node is never looked up (a job asks one GPU or more)
            return
        h = self.by_free[f]
        heapq.heappush(h, node)
        if len(h) > 4 * count[f] + 64:  # drop stale entries before they outnumber live ones
            self.by_free[f] = sorted({i for i in h if self.free[i] == f})

    def _lowest(self, f: int) -> int:
        h = self.by_free[f]
        while self.free[h[0]] != f:
            heapq.heappop(h)
        return h[0]

    def place(self, slots: int, milli: int = 0) -> tuple[int, ...] | None:
        """Same answer as :func:`traingate.capacity.gang.place` on ``free``. ``milli`` (a request below
        one GPU) is for pools with shared GPUs (``traingate.capacity.shared``): here it is always 0."""
        gpn = self.gpn
        if slots <= gpn:
            for f in range(slots, gpn + 1):
                if self.count[f]:
                    return (self._lowest(f),)
            return None
        k = nodes_needed(slots, gpn)
        if self.count[gpn] < k:
            return None
        h = self.by_free[gpn]
        got: list[int] = []
        while len(got) < k:  # the k lowest whole nodes, as gang.place takes them
            i = heapq.heappop(h)
            if self.free[i] == gpn and (not got or got[-1] != i):
                got.append(i)
        for i in got:
            heapq.heappush(h, i)
        return tuple(got)

    def fits(self, slots: int, milli: int = 0) -> bool:
        """Whether :meth:`place` would find nodes."""
        if slots <= self.gpn:
            return slots <= self.top
        return self.count[self.gpn] >= nodes_needed(slots, self.gpn)

    def take(self, slots: int, nodes: tuple[int, ...]) -> None:
        gpn = self.gpn
        if slots <= gpn:
            for n in nodes:
                self._set(n, self.free[n] - slots)
            self.total -= slots * len(nodes)
            return
        # A gang job takes whole nodes (``place``): each goes from gpn free to none, counted at once (what
        # ``_set`` does per node; a full node has no heap entry to push).
        free, count, k = self.free, self.count, len(nodes)
        for n in nodes:
            assert free[n] == gpn, f"node {n}: {free[n]} free, a gang job takes whole nodes"
            free[n] = 0
        count[gpn] -= k
        count[0] += k
        if self.top == gpn and not count[gpn]:
            t = gpn
            while t and not count[t]:
                t -= 1
            self.top = t
        self.total -= gpn * k

    def release(self, slots: int, nodes: tuple[int, ...]) -> None:
        gpn = self.gpn
        if slots <= gpn:
            for n in nodes:
                self._set(n, self.free[n] + slots)
            self.total += slots * len(nodes)
            return
        # A gang job's nodes are whole again: counted at once, each pushed to the whole nodes' heap.
        free, count, k = self.free, self.count, len(nodes)
        h = self.by_free[gpn]
        push = heapq.heappush
        for n in nodes:
            assert not free[n], f"node {n}: {free[n]} free under a gang job"
            free[n] = gpn
            push(h, n)
        count[0] -= k
        count[gpn] += k
        self.top = gpn
        if len(h) > 4 * count[gpn] + 64:
            self.by_free[gpn] = sorted({i for i in h if free[i] == gpn})
        self.total += gpn * k

    def fragmented(self, head_slots: int | None) -> float:
        """Same answer as :func:`traingate.capacity.gang.fragmented` on ``free``."""
        if head_slots is None or self.total < head_slots or self.fits(head_slots):
            return 0
        return self.total


class Running:
    """The running jobs of one pool, the GPUs each team holds, and each job's predicted end."""

    shared = False  # whether its GPUs may be shared by requests below one GPU (traingate.capacity.shared)

    def __init__(self, nodes: int, gpus_per_node: int) -> None:
        self.gpn = gpus_per_node
        self.free = FreeIndex(nodes, gpus_per_node)
        self.jobs: dict[str, Job] = {}
        self.held: dict[str, float] = {}  # team -> GPUs held now
        self._n = 0
        # Each running job has one entry in one of two sorted lists, taken out when it ends:
        self._ends: list[tuple[float, str]] = []  # (predicted end, id): still ahead
        self._late: list[tuple[float, str]] = []  # (-start, id): past its prediction or none
        self._entry: dict[str, tuple[tuple[float, str], bool]] = {}  # id -> its entry, whether in _late
        # The last reservation: the head's slots, "now" it holds below, its answer, the "now" it was
        # found at, and for a gang head how many nodes beyond the k it needs are whole by the answer and
        # how many more may be whole before it. The answer is decided by which running jobs are predicted
        # to end before it; a job released before it stays so until "now" passes its end and then,
        # counted late (predicted to end at now + the time it has run), until its end passes the answer
        # (``_holds``). Kept when a job starts that is predicted to end (not late) by the answer: released
        # before the answer and holding slots that were free, it moves the answer neither way; for a gang
        # head also when one predicted past it takes nodes whole by it that are spared (``_spares``).
        # Kept when a job ends that leaves the answer in place (``_keeps``).
        self._cache: list | None = None
        self._on: list[list[str]] = [[] for _ in range(nodes)]  # node -> its running jobs of one node
        # The jobs removed since the last pass (``plan_pass`` empties it), or None once anything else
        # changed since (a job added outside a pass, predictions changed): see ``Settled``.
        self._gone: list[Job] | None = []

    def add(self, job: Job, predicted_s: float | None) -> None:
        """``job`` started (``started_s`` and ``nodes`` set); ``predicted_s`` its predicted whole run."""
        assert job.started_s is not None
        self._take(job)
        self.jobs[job.job_id] = job
        self._n += 1
        self._gone = None
        if job.slots <= self.gpn:
            self._on[job.nodes[0]].append(job.job_id)
        rem = None if predicted_s is None else max(predicted_s - job.done_s, 0.0)
        end = None if rem is None else job.started_s + job.overhead_s + rem  # policy.predicted_end's sum
        c = self._cache
        if end is None or end <= job.started_s:
            e = (-job.started_s, job.job_id)
            insort(self._late, e)
            self._entry[job.job_id] = (e, True)
            self._cache = None
        else:
            e = (end, job.job_id)
            insort(self._ends, e)
            self._entry[job.job_id] = (e, False)
            if c is not None:
                if c[2] is None:
                    c[1] = min(c[1], end)
                elif end <= c[2]:
                    c[1] = min(c[1], _holds(end, job.started_s, c[2]))
                elif not self._spares(c, job):
                    self._cache = None

    def _spares(self, c: list, job: Job) -> bool:
        """Whether reservation ``c`` of a head wider than a node holds with ``job`` started (its nodes
        already taken), predicted to end past the answer. The answer is the k-th earliest of the nodes'
        whole times (see ``_keeps``), and ``c[4]`` counts at least how many nodes beyond k are whole by
        it; the job moves the time of each of its nodes that was whole by the answer past it, and the
        answer stays while that count stays at 0 or more. A node of one node's jobs was whole by it
        unless one of them is predicted past it (a late job's value at ``c[3]`` bounds it from below)."""
        gpn = self.gpn
        if c[0] <= gpn:
            return False
        if job.slots > gpn:
            lost = len(job.nodes)  # whole nodes, held past the answer now
        else:
            lost = 1
            answer, entry, jobs, twice = c[2], self._entry, self.jobs, 2 * c[3]
            others = self._on[job.nodes[0]]  # the job itself last
            for x in range(len(others) - 1):
                jid = others[x]
                (v, _), late = entry[jid]
                if late:
                    v = twice - jobs[jid].started_s  # type: ignore[operator]
                if v > answer:
                    lost = 0  # its node was whole past the answer already
                    break
        if lost > c[4]:
            return False
        c[4] -= lost
        return True

    def predictions_changed(self) -> None:
        """A job that may wait here was predicted anew (a job ended in another pool): a new version, so
        the next pass does not take the last one's decisions on trust (see ``Settled``)."""
        self._n += 1
        self._gone = None

    def remove(self, job_id: str) -> Job:
        self._n += 1  # a new version of the running set
        job = self.jobs.pop(job_id)
        if self._gone is not None:
            self._gone.append(job)
        e, is_late = self._entry.pop(job_id)
        if job.slots <= self.gpn:
            self._on[job.nodes[0]].remove(job_id)
        c = self._cache
        if c is not None and not self._keeps(c, job, e, is_late):
            self._cache = None
        lst = self._late if is_late else self._ends
        del lst[bisect_left(lst, e)]
        self._release(job)
        return job

    def _keeps(self, c: list, job: Job, e: tuple[float, str], is_late: bool) -> bool:
        """Whether reservation ``c`` holds without ``job`` (already out of ``_on``). For a head wider than
        a node the answer is the end by which enough nodes are whole: each node is whole at the latest
        predicted end of its jobs, and the answer is the k-th earliest of these (k: the nodes still
        wanted), which holds while fewer than k nodes are whole before it and k or more by it. An end
        moves only its nodes' times, and only earlier: the answer stays when each stays on its side of
        the answer, and else while ``c[5]`` (how many more nodes may be whole before it; ``reserve``) is
        not spent. The cache is read only while "now" is before ``c[1]``, while each job predicted to
        end before the answer is still predicted so (at its end, or late and below the answer); a late
        job's end (now + time run) only grows, so its value at ``c[3]`` bounds it from below."""
        answer = c[2]
        if answer is None:
            return False
        gpn = self.gpn
        entry, jobs, twice = self._entry, self.jobs, 2 * c[3]
        if job.slots > gpn:  # its nodes are whole now
            if c[0] <= gpn:
                return False  # a head of one node fits now
            if not is_late and e[0] < answer:
                return True  # they were whole before the answer
            return self._spend(c, len(job.nodes))
        others = self._on[job.nodes[0]]
        if c[0] <= gpn:
            # A head of one node: the answer is the earliest time a node has room enough. This node has more
            # room now, and the answer stays unless the node has room enough before it: counting every job
            # of the node that may end before the answer, it has not.
            room = self.free.free[job.nodes[0]] + job.slots  # the job's slots still counted held here
            for jid in others:
                (v, _), late = entry[jid]
                if late:
                    v = twice - jobs[jid].started_s  # type: ignore[operator]
                if v < answer:
                    room += jobs[jid].slots
            return room < c[0]
        below = not is_late and e[0] < answer  # the node's time below the answer with the job and without
        for jid in others:
            (v, _), late = entry[jid]
            if late:
                v = twice - jobs[jid].started_s  # type: ignore[operator]
            if v > answer:
                return True  # above the answer with the job and without it
            if late or v == answer:
                below = False
        return below or self._spend(c, 1)

    @staticmethod
    def _spend(c: list, nodes: int) -> bool:
        """Whether ``nodes`` more nodes may be whole before the answer of gang reservation ``c``; if so,
        counted."""
        if nodes > c[5]:
            return False
        c[5] -= nodes
        return True

    def _take(self, job: Job) -> None:
        """``job``'s GPUs are held: taken from the free ones and counted for its team."""
        s, gpn = job.slots, self.gpn
        self.free.take(s, job.nodes)
        self.held[job.team] = self.held.get(job.team, 0) + (s if s <= gpn else -(-s // gpn) * gpn)  # footprint

    def _release(self, job: Job) -> None:
        s, gpn = job.slots, self.gpn
        self.free.release(s, job.nodes)
        self.held[job.team] -= s if s <= gpn else -(-s // gpn) * gpn  # footprint

    def reserve(self, job: Job, now: float) -> float | None:
        """Same answer as :func:`traingate.capacity.policy.reserve` for a ``job`` that does not fit now:
        the running jobs released in the order of their predicted ends until it fits."""
        c = self._cache
        if c is not None and c[0] == job.slots and now < c[1]:
            return c[2]
        ends, late, jobs, entry = self._ends, self._late, self.jobs, self._entry
        ne = len(ends)
        i = 0
        while i < ne and ends[i][0] <= now:  # now past its predicted end: late from here on
            jid = ends[i][1]
            e = (-jobs[jid].started_s, jid)  # type: ignore[operator]
            insort(late, e)
            entry[jid] = (e, True)
            i += 1
        if i:
            del ends[:i]
            i = 0
            ne = len(ends)
        gpn = self.gpn
        free = self.free.free
        small = job.slots <= gpn
        want = job.slots
        k = nodes_needed(job.slots, gpn)
        wholes = self.free.count[gpn]
        freed = free[:]
        # Both lists merged in order; equal ends may come in any order: the answer is an end, the same
        # whichever of them fits it. late's end is now + (now - start), policy.predicted_end's. The jobs
        # used are ends[:i] and late[:j].
        nl = len(late)
        j = 0
        inf = math.inf
        found: float | None = None
        lo, lo_end = wholes, -inf  # the nodes whole before the end of the last whole-making step, and that end
        e_end = ends[0][0] if ne else inf
        l_end = now + (now + late[0][0]) if nl else inf
        while i < ne or j < nl:
            if e_end <= l_end:
                end, jid = e_end, ends[i][1]
                i += 1
                e_end = ends[i][0] if i < ne else inf
            else:
                end, jid = l_end, late[j][1]
                j += 1
                l_end = now + (now + late[j][0]) if j < nl else inf
            r = jobs[jid]
            rs = r.slots
            if rs > gpn:  # a gang job held its nodes whole: they are whole again, and nothing else frees them
                if small:
                    found = end
                    break
                if end != lo_end:
                    lo, lo_end = wholes, end
                wholes += len(r.nodes)
                if wholes >= k:
                    found = end
                    break
                continue
            n = r.nodes[0]
            after = freed[n] + rs
            freed[n] = after
            if small:  # one node with room enough
                if after >= want:
                    found = end
                    break
            elif after == gpn:  # k whole nodes
                if end != lo_end:
                    lo, lo_end = wholes, end
                wholes += 1
                if wholes >= k:
                    found = end
                    break
        # The answer holds until a job it used is late and predicted past it. No answer (every job used)
        # holds until the first of ends is late (it is over at once when late has any job). late is by
        # start, latest first: the last one used started earliest.
        if found is None:
            first_end = -inf if j else ends[0][0] if i else inf
        else:
            first_end = found if not j else min(found, _holds(-inf, -late[j - 1][0], found))
            for u in range(i):  # by end: once one ends after the bound so far, so do the rest
                u_end, jid = ends[u]
                if u_end >= first_end:
                    break
                first_end = min(first_end, _holds(u_end, jobs[jid].started_s, found))  # type: ignore[arg-type]
        # For a head wider than a node, how many nodes beyond the k it needs are whole by the answer (at
        # least: jobs that end at the answer after the k-th node were not looked at; see ``_spares``), and
        # how many more may be whole before it with the answer unchanged (see ``_keeps``).
        gang = found is not None and not small
        self._cache = [job.slots, first_end, found, now, wholes - k if gang else 0, k - 1 - lo if gang else 0]
        return found


def _holds(end: float, start: float, answer: float) -> float:
    """Until when a running job that started at ``start``, predicted to end at ``end`` before ``answer``,
    stays predicted to end before it: past ``end`` it is late, predicted to end at now + (now - start)
    (``policy.predicted_end``), which reaches ``answer`` at (answer + start) / 2, less a margin for the
    rounding of that sum."""
    half = (answer + start) / 2
    return max(end, half - 1e-9 * (1.0 + abs(half)))


class _Group:
    """Waiting jobs the policy decides alike, in submission order; ``jobs[off:]`` still wait. A
    ``single`` group holds one job that is decided alone (see ``Queue``)."""

    __slots__ = ("jobs", "late", "off", "priority", "single", "slots")

    def __init__(self, priority: str, slots: int, single: bool = False) -> None:
        self.jobs: list[Job] = []
        self.off = 0
        self.priority = priority
        self.slots = slots  # what each of its jobs asks
        self.late = False  # given up on for its prediction alone (see Queue._late)
        self.single = single


# A pass's record, kept on its queue: the version of the running set and the predictions after it
# (``Running._n``), the order signature (``_order_signature``), its head's group, the head's
# reservation, the head's id, and whether the pass preempted nothing. When the next pass
# finds the same version and order, every group that waited then, but those of a class that may
# preempt, waits on (``plan_pass`` says why). When jobs have only ended since (``Running._gone``) and
# the queue is told whose predictions moved (``Queue.repredicted``), so do the groups that still do
# not fit and those given up on for their prediction alone whose prediction stayed, while the head
# still does not fit and keeps its reservation (``_after_ends`` says why).
Settled = tuple[int, Any, "_Group | None", "float | None", "str | None", bool]


class Queue:
    """The waiting jobs of one pool. Grouped by (class, team, slots): first attempts without an
    estimate of their own (each predicted from the same history), and apart from them the jobs
    whose prediction is discredited (none of them is predicted); the rest (jobs with an estimate of
    their own, requeued jobs with their work done and restart cost) each in a ``single`` group of its
    own, which a pass leaves out, looks at again and gives up on as it does any group. ``reported``:
    its owner calls :meth:`repredicted` whenever a job end moves a waiting job's prediction (and
    ``Running.predictions_changed`` when it cannot say whose); then a pass after job ends may leave out
    what the last pass gave up on (see ``Settled``)."""

    def __init__(self, reported: bool = False) -> None:
        self.byid: dict[str, Job] = {}
        self._groups: dict[tuple[str, str, int, int, bool], _Group] = {}
        self._by_key: dict[tuple[str, int], list[_Group]] = {}  # (team, slots) -> its groups
        self._group_of: dict[str, _Group] = {}
        self._live: dict[int, _Group] = {}  # the groups with a waiting job, by id
        self._live_n: dict[str, int] = {}  # class -> how many of them are of it
        # slots -> the live groups whose jobs ask that many, by id: a pass after job ends looks only at the
        # sizes that fit now (``_after_ends``), not at every live group (tens under a long queue).
        self._sized: dict[int, dict[int, _Group]] = {}
        # The aged list of the order's signature (``_order_signature``): the cutoff it was listed at, the
        # earliest submission of a first job not past it since, and the list; see ``_first_moved``.
        self._aged: list | None = None
        # Groups that had no waiting job and have one since the last pass, and that pass's record:
        # see ``Settled``.
        self._fresh: list[_Group] = []
        self._settled: Settled | None = None
        # The groups the passes since the last full one gave up on for their prediction alone (they fit
        # and were predicted to end after the head's reservation, or were not predicted), by id; and the
        # (team, slots) whose predictions moved since the last pass (None: not reported).
        self._late: dict[int, _Group] = {}  # by id; each has ``late`` set
        self._quiet: Plan | None = None  # the last plan that started nothing and held nothing by quota
        self._ranking: tuple | None = None  # the teams' last fair-share ranking (see ``_ranking``)
        self._repredicted: set[tuple[str, int]] | None = set() if reported else None

    def __len__(self) -> int:
        return len(self.byid)

    def add(self, job: Job, discredited: bool = False) -> None:
        """Enqueue ``job``; ``discredited``: the predictor gives it no prediction any more."""
        self.byid[job.job_id] = job
        plain = not (job.attempt or job.est_duration_s is not None or job.overhead_s or job.done_s)
        k = (job.priority, job.team, job.slots, job.milli, discredited)
        g = None if not (plain or discredited) else self._groups.get(k)
        if g is None:
            if plain or discredited:
                g = self._groups[k] = _Group(job.priority, job.slots)
            else:  # decided alone: a group of its own
                g = _Group(job.priority, job.slots, single=True)
            self._by_key.setdefault((job.team, job.slots), []).append(g)
        if g.off == len(g.jobs):
            self._fresh.append(g)
            self._enliven(g)
            self._first_moved(None, job)
        self._group_of[job.job_id] = g
        if g.off > 256 and g.off * 2 > len(g.jobs):
            del g.jobs[: g.off]
            g.off = 0
        key = (job.submit_s, job.job_id)
        if g.off == len(g.jobs) or (g.jobs[-1].submit_s, g.jobs[-1].job_id) < key:
            g.jobs.append(job)
        else:  # a requeued job: back at its place in submission order
            at = bisect_right(g.jobs, key, lo=g.off, key=lambda j: (j.submit_s, j.job_id))
            g.jobs.insert(at, job)
            if at == g.off:  # the group's first job, looked at anew
                self._fresh.append(g)
                self._first_moved(None, job)  # submitted before the one behind it

    def _enliven(self, g: _Group) -> None:
        """``g`` has a waiting job again."""
        self._live[id(g)] = g
        sized = self._sized.get(g.slots)
        if sized is None:
            sized = self._sized[g.slots] = {}
        sized[id(g)] = g
        self._live_n[g.priority] = self._live_n.get(g.priority, 0) + 1

    def _first_moved(self, old: Job | None, new: Job | None) -> None:
        """A live group's first job ``old`` left it, or ``new`` became one (a group's jobs are in submission
        order: the job behind ``old`` was submitted after it, the one behind ``new`` before it). The aged
        list kept for the order's signature (``_order_signature``) is listed anew if ``old`` is on it;
        ``new`` is on it once the cutoff reaches its submission."""
        kept = self._aged
        if kept is None:
            return
        if old is not None and old.submit_s <= kept[0]:
            self._aged = None
        elif new is not None and new.submit_s < kept[1]:
            kept[1] = new.submit_s

    def repredicted(self, team: str, slots: int) -> None:
        """The prediction of the waiting jobs of ``team`` asking ``slots`` moved (a job like them ended)."""
        if self._repredicted is not None:
            self._repredicted.add((team, slots))

    def pop(self, job_id: str) -> Job:
        """Remove the waiting job ``job_id`` wherever it stands."""
        job = self.byid[job_id]
        g = self._group_of[job_id]
        self._take(job, g, g.jobs.index(job, g.off))
        return job

    def _untake(self, job: Job, g: _Group) -> None:
        """Put back a job that ``_take`` removed, at its place in its group."""
        self.byid[job.job_id] = job
        self._group_of[job.job_id] = g
        self._first_moved(None, job)  # it may be first again, submitted before the one behind it
        if g.off == len(g.jobs):
            self._enliven(g)
            if g.single:
                self._by_key.setdefault((job.team, job.slots), []).append(g)
        if g.off and g.jobs[g.off - 1] is job:
            g.off -= 1
        else:
            key = (job.submit_s, job.job_id)
            g.jobs.insert(bisect_right(g.jobs, key, lo=g.off, key=lambda j: (j.submit_s, j.job_id)), job)

    def _take(self, job: Job, g: _Group, pos: int) -> int:
        """Remove a started job; the position of the group's next job."""
        del self.byid[job.job_id]
        del self._group_of[job.job_id]
        if pos == g.off:
            g.off += 1
            nxt = g.off
            self._first_moved(job, None)  # the next one, if any, was submitted after it
        else:
            del g.jobs[pos]
            nxt = pos
        if g.off == len(g.jobs):
            del self._live[id(g)]
            del self._sized[g.slots][id(g)]
            self._live_n[g.priority] -= 1
            if g.single:  # done with: no job joins it
                self._by_key[(job.team, job.slots)].remove(g)
        return nxt

    def preempting(self, classes: Mapping[str, PriorityClass]) -> bool:
        """Whether a group of a class that may preempt waits."""
        for p, n in self._live_n.items():  # a loop, not any() over a generator: asked at most passes
            if n and classes[p].preempts:
                return True
        return False


def _key_maker(rules: Rules, usage: Mapping[str, float], predict: Predictor, now: float, queue: Queue) -> Any:
    """The policy's sort key (``policy.order_key``, as ``policy.queue_order`` sorts by it)."""
    teams: set[str] = set()
    if rules.policy.order is Order.MULTIFACTOR:
        teams = {g.jobs[g.off].team for g in queue._live.values()}
    return order_key(
        rules.policy, rules.classes, usage, predict, now, rules.slurm_priority, teams, rules.starvation_bound_s
    )


def _order_signature(rules: Rules, usage: Mapping[str, float], now: float, queue: Queue) -> tuple | None:
    """What the waiting jobs' order depends on besides the jobs and their predictions: nothing under
    fifo, priority and sjf; the teams' fair-share ranking; None under multifactor and hrrn (waits move
    them). Under ``+aged`` also which groups' first jobs are past the starvation bound (a group is ranked
    by its first job, and a job crossing the bound moves ahead)."""
    order = rules.policy.order
    if order is Order.MULTIFACTOR or order is Order.HRRN:
        return None
    sig: tuple = _ranking(usage, queue) if order is Order.FAIRSHARE else ()
    if rules.policy.aged and rules.starvation_bound_s is not None:
        cutoff = now - rules.starvation_bound_s
        kept = queue._aged
        # No job on the list has left its group's first place and no first job has reached the bound since
        # (``Queue._first_moved``): the same list (a group that leaves ``_live`` and comes back, last, does
        # so with a new first job, on the list only once past the bound).
        if kept is not None and kept[0] <= cutoff < kept[1]:
            return (sig, kept[2])
        aged = []
        nxt = math.inf  # the earliest submission of a first job not yet past the bound
        for g in queue._live.values():
            j = g.jobs[g.off]
            if j.submit_s <= cutoff:
                aged.append(j.job_id)
            elif j.submit_s < nxt:
                nxt = j.submit_s
        # In the dict's order: the same jobs listed in another order count as a change (the pass then
        # looks at every group), which is slower but never wrong.
        queue._aged = [cutoff, nxt, tuple(aged)]
        sig = (sig, queue._aged[2])
    return sig


def _ranking(usage: Mapping[str, float], queue: Queue) -> tuple:
    """The teams from the least used, each with whether it ties the one before (the first: 0.0, a team
    without usage). Teams that tie may come in either order: a change, slower but never wrong. The
    ranking rarely changes from event to event: kept on the queue when no two teams tie, and while the
    teams it lists are those of ``usage`` and their usages still rise strictly along it (the first still
    0.0 or not as it was), sorting them again would list them the same."""
    kept = queue._ranking
    if kept is not None and len(usage) == kept[3]:
        first, rest, sig, _ = kept
        get = usage.get
        last = get(first)
        if last is not None and (last == 0.0) is sig[1]:
            for t in rest:
                v = get(t)
                if v is None or not last < v:
                    break
                last = v
            else:
                return sig
    ranked: list[Any] = []
    last = 0.0
    for t, v in sorted(usage.items(), key=itemgetter(1)):
        ranked += (t, v == last)
        last = v
    sig = tuple(ranked)
    ties = any(ranked[3::2])
    queue._ranking = None if ties or not ranked else (ranked[0], tuple(ranked[2::2]), sig, len(usage))
    return sig


def plan_pass(
    now: float,
    pool: PoolConfig,
    run: Running,
    queue: Queue,
    rules: Rules,
    usage: Mapping[str, float],
    predict: Predictor,
) -> tuple[Plan, list[Job]]:
    """``schedule(now, pool, running, waiting, rules, usage, predict)``'s plan, carried out on
    ``run`` and ``queue`` (started jobs run as ``started(job, now, nodes)``, victims are removed);
    returns the plan and the victims as they ran. ``held_by_quota`` lists the quota-held jobs the
    pass looked at (a group's first, not every job behind it; behind the head, only those that could
    preempt or had room to backfill)."""
    gpn = pool.gpus_per_node
    classes = rules.classes
    sig = _order_signature(rules, usage, now, queue)
    settled = queue._settled
    # Nothing has started or ended since the last pass (so the free GPUs, the quotas held and every
    # waiting job's prediction are as they were), and the waiting jobs keep their order: then the
    # groups that pass gave up on would be given up on again (see ``Settled``), and this pass looks
    # only at the others, the groups of classes that may preempt, and the last head's group.
    same_order = settled is not None and sig is not None and settled[1] == sig
    # Not after a pass that preempted: the GPUs it freed may fit what it gave up on before.
    skip = same_order and settled[0] == run._n and settled[5]  # type: ignore[index]
    extra: list[_Group] = []
    if same_order and not skip:
        # Jobs ended since: the groups that may decide otherwise now, if the others may be left out.
        after = _after_ends(now, run, queue, rules, settled, predict)  # type: ignore[arg-type]
        if after is not None:
            skip, extra = True, after
    widened = False
    if skip and not queue._fresh and not extra:
        same = _unchanged(now, run, queue, rules, settled)  # type: ignore[arg-type]
        if isinstance(same, Plan):
            assert settled is not None
            _record(run, queue, (run._n, sig, settled[2], same.reserved_s, same.head, settled[5]))
            return same, []
        if same is not None:  # the same head, its reservation moved
            settled = _widened(now, run, queue, rules, predict, settled, same.moved, extra)  # type: ignore[arg-type]
            widened = skip = settled is not None
    keyf = _key_maker(rules, usage, predict, now, queue)
    while True:
        heap: list[tuple[tuple, Any, int]] = []
        looked: set[int] = set()
        groups: list[_Group] = []  # those looked at, while skipping
        if settled is not None and skip:
            preempting = (
                [g for g in queue._live.values() if classes[g.priority].preempts]
                if rules.policy.preempt and queue.preempting(classes)
                else []
            )
            for h in (*queue._fresh, *preempting, settled[2], *extra):
                if h is not None and id(h) not in looked and h.off < len(h.jobs):
                    looked.add(id(h))
                    groups.append(h)
                    heap.append((keyf(h.jobs[h.off]), h, h.off))
        else:
            heap = [(keyf(g.jobs[g.off]), g, g.off) for g in queue._live.values()]
        plan = _pass(now, gpn, run, queue, rules, predict, keyf, heap, (settled, looked) if settled and skip else None)
        if not isinstance(plan, _Retry):
            break
        if not widened:
            settled = _widened(now, run, queue, rules, predict, settled, plan.moved, extra)  # type: ignore[arg-type]
            widened = skip = settled is not None
            if widened:
                continue
        skip = False  # the head is not the last pass's: every group is looked at
    queue._fresh.clear()
    done, victims, head_group, late = plan
    known = queue._late
    if victims or not skip:  # after a preemption, nothing is known of the groups given up on before it
        for g in known.values():
            g.late = False
        known.clear()
    else:  # the groups left out keep what the last pass knew of them
        for g in groups:
            if g.late:
                g.late = False
                del known[id(g)]
    if not victims:
        for g in late:
            g.late = True
            known[id(g)] = g
    _record(run, queue, (run._n, sig, head_group, done.reserved_s, done.head, not victims))
    return done, victims


def _record(run: Running, queue: Queue, settled: Settled) -> None:
    """Keep ``settled`` as the last pass's record; what happens from here is reported against it."""
    queue._settled = settled
    if run._gone is None:
        run._gone = []
    else:
        run._gone.clear()
    if queue._repredicted is not None:  # kept by a queue that is told (``reported``)
        queue._repredicted.clear()


def _after_ends(
    now: float, run: Running, queue: Queue, rules: Rules, settled: Settled, predict: Predictor
) -> list[_Group] | None:
    """After job ends (and arrivals) since the last pass, in the same order: the groups a pass must look
    at besides the fresh ones, those of classes that may preempt and the head's; or None when it must look
    at every group. Ending jobs free GPUs (a group that did not fit may fit now), release quota and move
    predictions (``Queue.repredicted``); nothing else changed (``Running._gone``). The last head still does
    not fit: then, up to it, a pass finds again only the groups the last one held by quota (their teams
    ended nothing), and so, if the head keeps its reservation, the same head (``_pass`` checks it). Behind
    it, a group that does not fit now will not fit at its turn (free GPUs only fall along a pass), and
    one given up on for its prediction alone (``Queue._late``) is given up on again while it is still
    predicted to end after the reservation (as "now" moves on, later still). Not under ``sjf``, whose
    order moves with the predictions; not on shared GPUs; not after a pass that preempted (the GPUs it
    freed make what it gave up on before undecided)."""
    gone = run._gone
    repredicted = queue._repredicted
    if gone is None or repredicted is None or run.shared or not settled[5] or rules.policy.order is Order.SJF:
        return None
    quotas = rules.quotas
    if quotas and any(quotas.get(j.team) is not None for j in gone):
        return None
    free = run.free
    g, head_id = settled[2], settled[4]
    if head_id is not None:
        head = g.jobs[g.off] if g is not None and g.off < len(g.jobs) else None
        if head is None or head.job_id != head_id or free.fits(head.slots, head.milli):
            return None
    gpn = free.gpn
    top, room = free.top, free.count[gpn] * gpn
    out = []
    for n, live in queue._sized.items():
        if live and (n <= top if n <= gpn else n <= room):  # free.fits
            for h in live.values():
                if not h.late:
                    out.append(h)
    shadow, margin = settled[3], rules.backfill_margin_s
    for k in repredicted:
        for h in queue._by_key.get(k, ()):
            if h.late:
                j = h.jobs[h.off]
                p = predict(j)
                if p is not None and now + j.overhead_s + max(p - j.done_s, 0.0) + margin <= shadow:  # type: ignore[operator]
                    out.append(h)
    return out


def _widened(
    now: float,
    run: Running,
    queue: Queue,
    rules: Rules,
    predict: Predictor,
    settled: Settled,
    moved: float | None,
    extra: list[_Group],
) -> Settled | None:
    """The last pass's record with the head's reservation ``moved``, and ``extra`` given the groups to look
    at again besides, when only that reservation moved (the same head; both reservations found): a group
    the last passes gave up on did not fit at its turn, and still would not, or was given up on for its
    prediction alone (``Queue._late``), and of these only those now predicted to end by ``moved`` may start.
    None when the head is another or a reservation is missing: every group is looked at."""
    if moved is None or settled[3] is None or run.shared:
        return None
    margin = rules.backfill_margin_s
    for h in queue._late.values():
        if h.off < len(h.jobs):
            j = h.jobs[h.off]
            p = predict(j)
            if p is not None and now + j.overhead_s + max(p - j.done_s, 0.0) + margin <= moved:
                extra.append(h)
    return (settled[0], settled[1], settled[2], moved, settled[4], settled[5])


def _unchanged(now: float, run: Running, queue: Queue, rules: Rules, settled: Settled) -> Plan | _Retry | None:
    """The plan of a pass that would look at the last head's group only (nothing started, the same
    order, no fresh group, and what ended since, if anything, leaves every group as the
    last pass left it: see ``Settled`` and ``_after_ends``), or None when it may decide
    otherwise: a group of a class that may preempt waits, the head's team is now over its quota (a job of
    its team backfilled behind it), or the head's reservation moved. The head's
    group did not fit with these free GPUs and quotas and still does not (its first job may be another
    one, when the last head started in another pool, of the same size); nothing behind it is looked at.
    A ``_Retry`` with the new reservation when only that moved."""
    g = settled[2]
    if g is not None and g.off == len(g.jobs):
        return None  # the last head has gone: the pass finds another
    if rules.policy.preempt and queue.preempting(rules.classes):
        return None
    head, shadow = None, None
    if g is not None:
        job = g.jobs[g.off]
        cap = rules.quotas.get(job.team) if rules.quotas else None
        if cap is not None:  # as _pass counts it: a job of its team started behind it may hold it by quota now
            need = job.milli / MILLI if job.milli else footprint(job.slots, run.gpn)
            if run.held.get(job.team, 0) + need - cap > 0:
                return None
        head = job.job_id
        shadow = run.reserve(job, now) if rules.policy.backfill else None
        if shadow != settled[3]:
            return _Retry(shadow)
    plan = queue._quiet  # most passes end here, on the same head and reservation as the one before
    if plan is None or plan.head != head or plan.reserved_s != shadow:
        plan = queue._quiet = Plan((), (), head, shadow, ())
    return plan


class _Retry(Exception):
    """A pass over the unsettled groups found a head or a reservation other than the last pass's;
    ``moved``: the same head with another reservation (that reservation), else None."""

    def __init__(self, moved: float | None = None) -> None:
        super().__init__()
        self.moved = moved


def _pass(
    now: float,
    gpn: int,
    run: Running,
    queue: Queue,
    rules: Rules,
    predict: Predictor,
    keyf: Any,
    heap: list[tuple[tuple, Any, int]],
    skipping: tuple[Settled, set[int]] | None,
) -> tuple[Plan, list[Job], _Group | None, list[_Group]] | _Retry:
    """:func:`plan_pass`'s loop over ``heap``, the waiting groups' first jobs.
    With ``skipping`` (the last pass's record, the ids of the groups in the heap) the heap holds only
    the groups that pass must look at; then a ``_Retry`` (nothing changed yet) when the head or its
    reservation differs from the last pass's. Also the head's group and the groups given up on for their
    prediction alone."""
    policy = rules.policy
    classes = rules.classes
    quotas = rules.quotas
    margin = rules.backfill_margin_s
    free = run.free
    shared = run.shared
    heapq.heapify(heap)
    # No job behind the head asks fewer slots (set when the head is found, from the jobs still to be
    # looked at); once even that many do not fit, only a preemption can start one.
    smallest = 0
    starts: list[Start] = []
    victims_out: list[Job] = []
    quota_held: list[str] = []
    dead: list[_Group] = []
    ahead: list[tuple[Job, _Group]] = []  # started before the head while skipping, as waiting
    late: list[_Group] = []  # given up on behind the head for their prediction alone (see Queue._late)
    head: Job | None = None
    head_group: _Group | None = None
    shadow: float | None = None
    # A head to find again, with the same reservation: then every group left out of the heap is given up
    # on, as the last pass gave up on it. A job looked at before the head may start (an arrival ahead
    # of it in order): it only takes free GPUs, which leaves out what the groups left out lacked; a
    # preemption before the head frees GPUs, and the pass starts over with every group.
    settled, looked = skipping if skipping is not None else (None, set())
    guard = settled is not None and settled[2] is not None

    def evict(victims: tuple[Job, ...], key: tuple) -> None:
        nonlocal settled, smallest
        if guard and head is None:
            raise _Retry
        for v in victims:
            victims_out.append(run.remove(v.job_id))
        if settled is not None:  # the groups left out are given up on, as the last pass gave up on them
            dead.extend(g for g in queue._live.values() if id(g) not in looked)
            settled = None
        # Freed slots and quota: groups given up on may start again from the next job after this one
        # (a group's keys never fall along it; under multifactor its jobs' ages differ).
        for g in dead:
            p = bisect_right(g.jobs, key, lo=g.off, key=keyf)
            if p < len(g.jobs):
                j = g.jobs[p]
                smallest = min(smallest, j.slots)
                heapq.heappush(heap, (keyf(j), g, p))
        dead.clear()

    def nothing_backfills() -> bool:
        """Whether no job behind the head may start but by preempting; then, without preemption, the
        pass is over, and with it the groups whose class cannot preempt are given up on at once (as
        each would be when reached: a preemption brings them back from ``dead``)."""
        if shadow is not None and (shared or free.fits(smallest)):
            return False
        if not policy.preempt:
            return True
        keep = []
        for e in heap:
            g = e[1]
            if classes[g.jobs[e[2]].priority].preempts:
                keep.append(e)
            else:
                dead.append(g)
        heapq.heapify(keep)
        heap[:] = keep
        return False

    def behind_head() -> bool:
        """Once the head is found: ``nothing_backfills()``, and else the heap cut down to the jobs that
        may still start: those of classes that may preempt, those of teams with a quota
        (their turn records them held), and those that fit now and are predicted to end by the
        reservation. Along a pass free slots only fall and predictions stay put (a preemption brings
        the groups left out back from ``dead``), so each job left out would be given up on at its turn."""
        nonlocal smallest
        # No reservation: nothing backfills, and smallest is not read. Shared GPUs: a request below one
        # GPU may fit beside others where no whole GPU is free, so the slot counts below do not tell.
        if shadow is None or shared:
            return nothing_backfills()
        keep = []
        low = free.gpn * len(free.free)
        top, wholes = free.top, free.count[gpn]
        preempt = policy.preempt
        for e in heap:
            g = e[1]
            j = g.jobs[e[2]]
            n = j.slots
            if n < low:
                low = n
            if preempt and classes[j.priority].preempts:
                keep.append(e)
            elif n <= top if n <= gpn else wholes * gpn >= n:  # it fits now (free.fits)
                if quotas and quotas.get(j.team) is not None:
                    keep.append(e)
                    continue
                p = predict(j)
                if p is not None and now + j.overhead_s + max(p - j.done_s, 0.0) + margin <= shadow:
                    keep.append(e)
                else:
                    dead.append(g)
                    late.append(g)
            else:
                dead.append(g)
        smallest = low if heap else 0
        if len(keep) < len(heap):
            heapq.heapify(keep)
            heap[:] = keep
        return nothing_backfills()

    try:
        while heap:
            key, g, pos = heapq.heappop(heap)
            job = g.jobs[pos]
            can_preempt = policy.preempt and classes[job.priority].preempts
            if head is not None and not can_preempt and (shadow is None or not free.fits(job.slots, job.milli)):
                dead.append(g)  # behind the head only a backfill could start it, and there is no room
                continue
            nodes: tuple[int, ...] | None = None
            how: How | None = None
            stop = False
            cap = quotas.get(job.team) if quotas else None
            over: float = 0
            if cap is not None:
                need = job.milli / MILLI if job.milli else footprint(job.slots, gpn)
                over = max(0, run.held.get(job.team, 0) + need - cap)
            if over:
                vs = (
                    choose_victims(
                        job,
                        now,
                        free.free,
                        list(run.jobs.values()),
                        gpn,
                        classes,
                        math.ceil(over),
                        rules.restart_cost_s,
                    )
                    if can_preempt
                    else None
                )
                if vs is None:
                    quota_held.append(job.job_id)
                else:
                    evict(vs, key)
                    nodes, how = free.place(job.slots, job.milli), How.PREEMPTION
            else:
                if head is None:
                    nodes = free.place(job.slots, job.milli)
                    how = How.IN_ORDER
                elif shadow is not None:
                    p = predict(job)
                    if p is not None and now + job.overhead_s + max(p - job.done_s, 0.0) + margin <= shadow:
                        nodes = free.place(job.slots, job.milli)
                        how = How.BACKFILL
                    elif not can_preempt:  # it fits (checked above): its prediction decides
                        late.append(g)
                if nodes is None and can_preempt:
                    vs = choose_victims(
                        job, now, free.free, list(run.jobs.values()), gpn, classes, 0, rules.restart_cost_s
                    )
                    if vs is not None:
                        evict(vs, key)
                        nodes, how = free.place(job.slots, job.milli), How.PREEMPTION
                if nodes is None and head is None:
                    head, head_group = job, g
                    if policy.backfill:
                        shadow = run.reserve(job, now)
                    elif not policy.preempt:
                        stop = True  # strict order: nothing behind the head may start
                    if guard:
                        assert settled is not None
                        if g is not settled[2]:
                            raise _Retry
                        if shadow != settled[3]:
                            raise _Retry(shadow)
                    stop = stop or behind_head()
            if nodes is not None:
                assert how is not None
                nxt = queue._take(job, g, pos)
                # Counted as running from now for later reservations and victim choices in this pass.
                run.add(started(job, now, nodes), predict(job))
                starts.append(Start(job.job_id, nodes, how))
                if guard and head is None:
                    ahead.append((job, g))
                if nxt < len(g.jobs):
                    heapq.heappush(heap, (keyf(g.jobs[nxt]), g, nxt))
                if head is not None and nothing_backfills():
                    break
            else:
                dead.append(g)
            if stop:
                break
        if guard and head is None:
            raise _Retry  # the last pass's head has gone (started in another pool)
    except _Retry as retry:
        for job, g in reversed(ahead):  # the pass starts over: as if none had started
            run.remove(job.job_id)
            queue._untake(job, g)
        return retry
    plan = Plan(
        tuple(starts),
        tuple([v.job_id for v in victims_out]) if victims_out else (),
        head.job_id if head else None,
        shadow,
        tuple(quota_held),
    )
    return plan, victims_out, head_group, late


def straightforward_pass(
    now: float,
    pool: PoolConfig,
    run: Running,
    queue: Queue,
    rules: Rules,
    usage: Mapping[str, float],
    predict: Predictor,
) -> tuple[Plan, list[Job]]:
    """:func:`plan_pass` done by ``policy.schedule`` over plain lists rebuilt every pass: the
    reference the tests compare ``plan_pass`` with, and the baseline of ``python -m bench simspeed``."""
    plan = schedule(now, pool, list(run.jobs.values()), list(queue.byid.values()), rules, usage, predict)
    victims = [run.remove(j) for j in plan.preempted]
    for s in plan.starts:
        job = queue.pop(s.job_id)
        run.add(started(job, now, s.nodes), predict(job))
    return plan, victims
