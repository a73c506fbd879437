"""Gang slots on the Prefect server: every training job holds all of its pool's slots at once.

The policy is :mod:`traingate.capacity.queue` (pure); this module carries it out with Prefect's
own mechanisms:

- the capacity config, as ``traingate pools bootstrap`` stored it: the Prefect Variable
  ``traingate-pools`` (so every worker and CLI reads the same config from the server);
- the queue: one Variable per job (``tgq-job-<job id>``) holding its ``Entry``, refreshed while it
  waits or runs; an entry not refreshed for ``STALE_S`` belongs to a dead orchestrator;
- the slots: the pool's global concurrency limit (named like the pool), and for a team with a
  quota on the pool the limit ``quota-<team>-<pool>``, taken in one atomic, leased request (a
  killed orchestrator's slots come back when the lease expires);
- starting is serialized per pool by a one-slot limit ``tgq-lock-<pool>``: decide, take the
  slots, publish "running", all under it, so two jobs never plan on the same free GPUs;
- preemption: the preemptor writes ``tgq-preempt-<victim>``; the victim's supervisor sees it on
  its next tick (``preempt_requested``), SIGTERMs its tree (emergency checkpoint), gives its
  slots back and waits in the queue again to resume (``tasks/train.py``);
- fair share: each team's decayed GPU-hours on a pool, ``tgq-usage-<pool>``, folded in when a job
  gives its slots back.

A server without ``traingate-pools`` (a temporary server of `traingate run`, a test harness) runs
jobs unscheduled, as before: ``for_job`` returns None.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.exceptions import ObjectNotFound

from traingate.capacity.gang import footprint
from traingate.capacity.policy import never_fits
from traingate.capacity.pools import CapacityConfig, CapacityError, parse_config
from traingate.capacity.queue import (
    RUNNING,
    WAITING,
    Decision,
    Entry,
    decide,
    describe_wait,
    fold_usage,
    fresh,
    key,
    usage_now,
)
from traingate.job import files, sizing
from traingate.job.stagejob import StageJob

CONFIG_VAR = "traingate-pools"
JOB_PREFIX = "tgq-job-"
PREEMPT_PREFIX = "tgq-preempt-"
USAGE_PREFIX = "tgq-usage-"
HISTORY_PREFIX = "tgq-history-"
HISTORY_N = 20
LEASE_S = 60.0  # the server's minimum; renewed every LEASE_S / 4 while held
POLL_S = 1.0  # a waiter re-decides this often
SAY_EVERY_S = 10.0  # a waiter prints its position this often
BEAT_S = 5.0  # a holder refreshes its entry this often
PREEMPT_POLL_S = 1.0


def pool_limit(pool: str) -> str:
    return pool


def quota_limit(team: str, pool: str) -> str:
    return f"quota-{key(team)}-{pool}"


def lock_limit(pool: str) -> str:
    return f"tgq-lock-{pool}"


def read_config(client: Any) -> CapacityConfig | None:
    var = client.read_variable_by_name(CONFIG_VAR)
    return None if var is None else parse_config(var.value, source=f"Prefect variable {CONFIG_VAR}")


def put_variable(client: Any, name: str, value: Any) -> None:
    """Create or update. Others create and delete the same names concurrently (a preemptor's request,
    the victim clearing it), so a create may find it created (409) and an update find it gone (404)."""
    for _ in range(5):
        try:
            if client.read_variable_by_name(name) is None:
                client.create_variable(VariableCreate(name=name, value=value))
            else:
                client.update_variable(VariableUpdate(name=name, value=value))
            return
        except httpx.HTTPStatusError as e:
            if e.response.status_code not in (404, 409):
                raise
    raise RuntimeError(f"Prefect variable {name}: created and deleted by others five times in a row")


def delete_variable(client: Any, name: str) -> None:
    with contextlib.suppress(ObjectNotFound):
        client.delete_variable_by_name(name)


def entries(client: Any, pool: str | None = None) -> list[Entry]:
    out = [
        Entry.from_json(v.value)
        for v in client.read_variables()
        if v.name.startswith(JOB_PREFIX) and isinstance(v.value, dict)
    ]
    return [e for e in out if pool is None or e.pool == pool]


def fresh_entries(client: Any, now: float) -> list[Entry]:
    return fresh(entries(client), now)


def usage_history(client: Any, pool: str) -> dict[str, tuple[float, float]]:
    var = client.read_variable_by_name(USAGE_PREFIX + pool)
    return {t: (float(u), float(a)) for t, (u, a) in (var.value if var is not None else {}).items()}


def history(client: Any, pool: str) -> dict[str, tuple[float, int]]:
    """Held seconds of finished jobs per experiment/stage/slots on ``pool``: (running mean, count)."""
    var = client.read_variable_by_name(HISTORY_PREFIX + pool)
    return {k: (float(m), int(n)) for k, (m, n) in (var.value if var is not None else {}).items()}


def _canary_step_s(job: StageJob) -> float | None:
    """The run's canary's mean step time (its sizing profile), when the canary ran before this stage."""
    if job.stage == "canary":
        return None
    result = files.read_result(Path(job.stage_dir).parent / "canary")
    profile = (result.metrics.get("profile") if result else None) or {}
    return profile.get("step_time_mean_s") or None


def _increment(client: Any, names: list[str], slots: int) -> str | None:
    """One try at ``slots`` of every named limit at once: the lease id, or None while they are taken."""
    try:
        resp = client.increment_concurrency_slots_with_lease(
            names=names, slots=slots, mode="concurrency", lease_duration=LEASE_S
        )
    except httpx.HTTPStatusError as e:
        if e.response.status_code == 423:  # not enough free slots: come back later
            return None
        raise
    body = resp.json()
    if len(body.get("limits") or []) != len(names):
        raise CapacityError(
            f"concurrency limits {names} do not all exist on the server; "
            f"run `traingate pools bootstrap POOLS.yaml` against it"
        )
    return str(body["lease_id"])


@contextlib.contextmanager
def pool_lock(client: Any, pool: str, timeout_s: float = 120.0) -> Iterator[None]:
    deadline = time.monotonic() + timeout_s
    while (lease := _increment(client, [lock_limit(pool)], 1)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the start lock of pool {pool} was not free for {timeout_s:.0f} s")
        time.sleep(0.05)
    try:
        yield
    finally:
        client.release_concurrency_slots_with_lease(lease)


class GangSlots:
    """One job's place in its pool's queue, then its slots. ``acquire`` -> train -> ``release``;
    after a preemption ``release(requeue=True)`` and ``acquire`` again."""

    def __init__(
        self, job: StageJob, cfg: CapacityConfig, say: Callable[[str], None], client_factory: Callable[[], Any]
    ):
        self.cfg, self.say, self._client = cfg, say, client_factory
        self.stage_dir = Path(job.stage_dir)
        self.max_steps = job.max_steps
        self.kind_key = f"{key(job.spec.identity.experiment)}/{job.stage}/{job.slots}"
        step_s = _canary_step_s(job)
        with client_factory() as client:
            est = (
                sizing.estimate_stage({"step_time_mean_s": step_s}, job.max_steps, job.slots, 0.0)["wall_s"]
                if step_s
                else history(client, job.pool).get(self.kind_key, (None, 0))[0]
            )
        self.entry = Entry(
            job_id=f"{job.run_id}-{job.stage}",
            run_id=job.run_id,
            stage=job.stage,
            team=job.team,
            priority=job.priority,
            pool=job.pool,
            slots=job.slots,
            submit_s=time.time(),
            checkpoint_every_s=job.checkpoint_interval_s(step_s),
            est_duration_s=est,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        why = never_fits(self.entry.job(), cfg.pools, cfg.priority_classes, cfg.quotas)
        if why is not None:  # refused before it ever enters the queue
            raise CapacityError(f"{job.run_id} {job.stage}: {why}")
        self.pool = cfg.pools[job.pool]
        self.name = JOB_PREFIX + key(self.entry.job_id)
        self.lease: str | None = None
        self.held_s = 0.0
        self.waited_s = 0.0
        self.preempted_by: str | None = None
        self.preempted_by_last: str | None = None  # who took the slots the last time (for the log)
        self._beat_stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._last_preempt_poll = 0.0

    @property
    def names(self) -> list[str]:
        limits = [pool_limit(self.entry.pool)]
        if self.entry.team in self.cfg.quotas and self.entry.pool in self.cfg.quotas[self.entry.team]:
            limits.append(quota_limit(self.entry.team, self.entry.pool))
        return limits

    @property
    def need(self) -> int:
        return footprint(self.entry.slots, self.pool.gpus_per_node)

    def acquire(self, stop_check: Callable[[], str | None]) -> str | None:
        """Wait in the queue until the policy starts this job and its slots are held.
        Returns None once held, or the reason it stopped waiting (a cancel)."""
        t0 = time.monotonic()
        said = -SAY_EVERY_S
        with self._client() as client:
            self._publish(client, state=WAITING)
            while True:
                if (why := stop_check()) is not None:
                    delete_variable(client, self.name)
                    return why
                d = self._decide(client)
                if d.start:
                    with pool_lock(client, self.entry.pool):
                        d = self._decide(client)
                        if d.start:
                            for v in d.victims:
                                put_variable(
                                    client, PREEMPT_PREFIX + key(v), {"by": self.entry.job_id, "at": time.time()}
                                )
                            self.lease = _increment(client, self.names, self.need)
                            if self.lease is not None:
                                # Requests are written under this lock: one left from before this start is stale.
                                delete_variable(client, PREEMPT_PREFIX + key(self.entry.job_id))
                                self.entry = self._publish(client, state=RUNNING, started_s=time.time(), nodes=d.nodes)
                                break
                else:
                    self._publish(client)
                if time.monotonic() - said >= SAY_EVERY_S:
                    said = time.monotonic()
                    self.say(describe_wait(d, time.monotonic() - t0, time.time()))
                time.sleep(POLL_S)
        self.waited_s += time.monotonic() - t0
        self.say(
            f"slots held: {self.need} of {self.entry.pool} ({d.why}; "
            f"waited {time.monotonic() - t0:.0f} s)" + (f"; preempting {', '.join(d.victims)}" if d.victims else "")
        )
        self._held_since = time.monotonic()
        self._beat_stop.clear()
        # In this context: Prefect's settings (which server) are context variables, not inherited by threads.
        self._beat = threading.Thread(
            target=contextvars.copy_context().run, args=(self._keep,), name="tg-slots", daemon=True
        )
        self._beat.start()
        return None

    def preempt_requested(self) -> str | None:
        """A reason to stop now: a higher-class job asked for this job's slots."""
        if self.lease is None or time.monotonic() - self._last_preempt_poll < PREEMPT_POLL_S:
            return None
        self._last_preempt_poll = time.monotonic()
        with self._client() as client:
            var = client.read_variable_by_name(PREEMPT_PREFIX + key(self.entry.job_id))
        if var is None:
            return None
        self.preempted_by = str(var.value.get("by"))
        return f"preempted by {self.preempted_by} (a higher priority class needs the slots)"

    def release(self, requeue: bool = False) -> None:
        """Give the slots back (every exit path); ``requeue``: stay in the queue to resume."""
        self._beat_stop.set()
        if self._beat is not None:
            self._beat.join(timeout=30)
        with self._client() as client:
            if self.lease is not None:
                client.release_concurrency_slots_with_lease(self.lease)
                self.held_s += time.monotonic() - self._held_since
                start = self.entry.started_s or time.time()
                hist = usage_history(client, self.entry.pool)
                hist[self.entry.team] = fold_usage(
                    hist.get(self.entry.team), self.need, start, time.time(), self.cfg.scheduling.half_life_h * 3600.0
                )
                put_variable(client, USAGE_PREFIX + self.entry.pool, {t: list(v) for t, v in hist.items()})
                self.lease = None
            if requeue:
                delete_variable(client, PREEMPT_PREFIX + key(self.entry.job_id))
                self._publish(client, state=WAITING, started_s=None, nodes=(), attempt=self.entry.attempt + 1)
            else:
                if self.preempted_by is None and self.held_s > 0:  # a whole run: what the next of its kind predicts
                    runs = history(client, self.entry.pool)
                    mean, n = runs.get(self.kind_key, (0.0, 0))
                    n = min(n, HISTORY_N - 1)  # a running mean over about the last HISTORY_N runs
                    runs[self.kind_key] = ((mean * n + self.held_s) / (n + 1), n + 1)
                    put_variable(client, HISTORY_PREFIX + self.entry.pool, {k: list(v) for k, v in runs.items()})
                delete_variable(client, self.name)
                delete_variable(client, PREEMPT_PREFIX + key(self.entry.job_id))
        self.preempted_by_last, self.preempted_by = self.preempted_by, None

    # ------------------------------------------------------------------ internals
    def _decide(self, client: Any) -> Decision:
        now = time.time()
        mine = self.entry.job_id
        live = [e for e in fresh(entries(client, self.entry.pool), now) if e.job_id != mine]
        live.append(dataclasses.replace(self.entry, beat_s=now))
        usage = usage_now(
            usage_history(client, self.entry.pool),
            [e for e in live if e.state == RUNNING],
            now,
            self.cfg.scheduling.half_life_h * 3600.0,
        )
        return decide(mine, live, self.cfg, now, usage)

    def _publish(self, client: Any, **changes: Any) -> Entry:
        self.entry = dataclasses.replace(self.entry, **changes, beat_s=time.time())
        put_variable(client, self.name, self.entry.to_json())
        return self.entry

    def _keep(self) -> None:
        """While held: renew the lease and refresh the entry (with the job's progress)."""

        with get_client(sync_client=True) as client:
            last_renew = time.monotonic()
            while not self._beat_stop.wait(BEAT_S):
                if self.lease is None:
                    return
                if time.monotonic() - last_renew >= LEASE_S / 4:
                    client.renew_concurrency_lease(UUID(self.lease), LEASE_S)
                    last_renew = time.monotonic()
                beats = files.read_heartbeats(self.stage_dir)
                step = beats[0].step if 0 in beats else None
                progress = f"step {step}/{self.max_steps}" if step is not None else ""
                self._publish(client, progress=progress)


def for_job(job: StageJob, say: Callable[[str], None]) -> GangSlots | None:
    """The job's gang slots when the server has a capacity config, else None (unscheduled)."""

    def factory() -> Any:
        return get_client(sync_client=True)

    with factory() as client:
        cfg = read_config(client)
    if cfg is None:
        return None
    return GangSlots(job, cfg, say, factory)
