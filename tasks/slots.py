"""Gang slots on the local engine: every training job holds all of its pool's slots at once.

The capacity config is the one ``traingate pools bootstrap`` stored on the Prefect server (the Variable
``traingate-pools``), so every worker and CLI schedules by the same file. Everything else is the pool's one
authority (:mod:`traingate.capacity.authority`), reached over a Unix socket in the state directory
(:mod:`traingate.capacity.channel`): it alone admits jobs in policy order (class, fair share, quotas and
entitlements, gang placement, backfill), asks running jobs to stop for a preempting class, and writes the
queue, usage and preemption records, each signed with a key only it holds. A waiting job costs the Prefect
server nothing: it blocks on its socket until the authority pushes its admission.

A preempted job's supervisor sees the request on its next tick (``preempt_requested``), SIGTERMs its tree
(emergency checkpoint), gives its slots back and waits in the queue again to resume (``tasks/train.py``).
A job whose lease could not be renewed stops the same way: it never trains without its slots.

A server without ``traingate-pools`` (a temporary server of `traingate run`, a test harness) runs jobs
unscheduled: ``for_job`` returns None.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.exceptions import ObjectNotFound

from traingate.capacity import entitlements, records
from traingate.capacity.channel import Seat, write_config
from traingate.capacity.gang import footprint
from traingate.capacity.policy import never_fits
from traingate.capacity.pools import CapacityConfig, CapacityError, parse_config
from traingate.capacity.queue import Entry, key
from traingate.job import files, sizing
from traingate.job.stagejob import StageJob
from traingate.settings import Settings

CONFIG_VAR = "traingate-pools"


def read_config(client: Any) -> CapacityConfig | None:
    var = client.read_variable_by_name(CONFIG_VAR)
    return None if var is None else parse_config(var.value, source=f"Prefect variable {CONFIG_VAR}")


def put_variable(client: Any, name: str, value: Any) -> None:
    """Create or update. Another writer may create or delete the same name at the same moment, so a create
    may find it created (409) and an update find it gone (404)."""
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


def _canary_step_s(job: StageJob) -> float | None:
    """The run's canary's mean step time (its sizing profile), when the canary ran before this stage."""
    if job.stage == "canary":
        return None
    result = files.read_result(Path(job.stage_dir).parent / "canary")
    profile = (result.metrics.get("profile") if result else None) or {}
    return profile.get("step_time_mean_s") or None


class GangSlots:
    """One job's place in its pool's queue, then its slots. ``acquire`` -> train -> ``release``;
    after a preemption ``release(requeue=True)`` and ``acquire`` again."""

    def __init__(self, job: StageJob, cfg: CapacityConfig, say: Callable[[str], None], state_dir: Path | None = None):
        self.cfg, self.say = cfg, say
        self.state_dir = Path(state_dir) if state_dir is not None else Settings.from_env().state_dir
        self.stage_dir = Path(job.stage_dir)
        self.max_steps = job.max_steps
        self.kind_key = f"{key(job.spec.identity.experiment)}/{job.stage}/{job.slots}"
        step_s = _canary_step_s(job)
        known = records.read_pool(self.state_dir, job.pool).of(records.HISTORY)
        est = (
            sizing.estimate_stage({"step_time_mean_s": step_s}, job.max_steps, job.slots, 0.0)["wall_s"]
            if step_s
            else (known[self.kind_key][0] if self.kind_key in known else None)
        )
        user = entitlements.os_user()
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
            user=user,
        )
        # Refused before it ever enters the queue (the authority checks the same against its peer's OS user).
        cap = cfg.quota_of(job.team, job.pool)
        why = entitlements.problem(cfg, user, job.team, job.priority, job.pool, job.slots) or never_fits(
            self.entry.job(), cfg.pools, cfg.priority_classes, {job.team: {job.pool: cap}} if cap else {}
        )
        if why is not None:
            raise CapacityError(f"{job.run_id} {job.stage}: {why}")
        self.pool = cfg.pools[job.pool]
        write_config(self.state_dir, job.pool, cfg)
        self.seat = Seat(self.state_dir, self.entry, say)
        self.seat.progress = self._progress
        self.held_s = 0.0
        self.waited_s = 0.0
        self.preempted_by: str | None = None
        self.preempted_by_last: str | None = None  # who took the slots the last time (for the log)
        self._held_since = 0.0

    @property
    def need(self) -> int:
        return footprint(self.entry.slots, self.pool.gpus_per_node)

    def acquire(self, stop_check: Callable[[], str | None]) -> str | None:
        """Wait in the queue until the authority starts this job and its slots are held.
        Returns None once held, or the reason it stopped waiting (a cancel)."""
        t0 = time.monotonic()
        why = self.seat.wait(stop_check)
        if why is not None:
            return why
        self.waited_s += time.monotonic() - t0
        got = self.seat.admitted or {}
        victims = got.get("victims") or []
        self.say(
            f"slots held: {self.need} of {self.entry.pool} ({got.get('how')}; waited {time.monotonic() - t0:.0f} s)"
            + (f"; preempting {', '.join(victims)}" if victims else "")
        )
        self._held_since = time.monotonic()
        return None

    def preempt_requested(self) -> str | None:
        """A reason to stop now: a higher-class job needs the slots, or the lease could not be renewed."""
        why = self.seat.stop_reason()
        if why is not None and self.preempted_by is None:
            self.preempted_by = self.seat.preempted_by or "a lost lease"
        return why

    def release(self, requeue: bool = False) -> None:
        """Give the slots back (every exit path); ``requeue``: stay in the queue to resume."""
        if self.seat.admitted is not None:
            self.held_s += time.monotonic() - self._held_since
        whole = not requeue and self.preempted_by is None and self.held_s > 0  # what the next of its kind predicts
        self.seat.release(requeue, self.kind_key if whole else "", self.held_s if whole else 0.0)
        self.preempted_by_last, self.preempted_by = self.preempted_by, None

    def _progress(self) -> str:
        beats = files.read_heartbeats(self.stage_dir)
        step = beats[0].step if 0 in beats else None
        return f"step {step}/{self.max_steps}" if step is not None else ""


def for_job(job: StageJob, cfg: CapacityConfig | None, say: Callable[[str], None]) -> GangSlots | None:
    """The job's gang slots when the server has a capacity config ``cfg`` (:func:`read_config`), else None
    (unscheduled)."""
    if cfg is None:
        return None
    return GangSlots(job, cfg, say)
