"""``Job``: what the scheduler knows about one attempt of one training job.

The names follow the StageJob the orchestrator builds (``pool``, ``slots``, ``team``,
``priority``), so turning one into the other is a field-for-field copy; the StageJob's
``checkpoint_every_steps`` becomes ``checkpoint_every_s`` through the canary's step time.
A ``Job`` never carries its true duration: the policy sees predictions only.

>>> j = Job("j1", team="vision", priority="research", pool="gpu-a100", slots=4, submit_s=0.0,
...         checkpoint_every_s=600.0)
>>> run = started(j, now=100.0, nodes=(2,))
>>> work_s(run, now=1400.0), at_risk_s(run, now=1400.0)
(1300.0, 100.0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    job_id: str
    team: str
    priority: str
    pool: str
    slots: int
    submit_s: float
    est_duration_s: float | None = None  # the submitter's prediction of its whole run; None: ask history
    checkpoint_every_s: float | None = None  # None: no periodic checkpoints, a preemption loses the attempt
    # While it runs (started_s is None while it waits):
    started_s: float | None = None
    nodes: tuple[int, ...] = ()
    # Seconds an attempt holds its slots before training progresses: restart cost on a resume,
    # the victims' checkpoint grace for a preemptor. Set before the attempt starts.
    overhead_s: float = 0.0
    done_s: float = 0.0  # durable work from earlier attempts: the next attempt resumes from here
    attempt: int = 0  # 0 = first attempt; +1 per preemption
    # A request below one GPU in thousandths of a GPU (500: half of one), packed onto a GPU it shares
    # with others (the replay's shared GPUs, traingate.capacity.shared); ``slots`` is then 1. 0: whole GPUs.
    milli: int = 0


def started(job: Job, now: float, nodes: tuple[int, ...], extra_overhead_s: float = 0.0) -> Job:
    # Every field spelled out: a replay starts a job per event, and dataclasses.replace costs twice this.
    return Job(
        job.job_id,
        job.team,
        job.priority,
        job.pool,
        job.slots,
        job.submit_s,
        job.est_duration_s,
        job.checkpoint_every_s,
        now,
        nodes,
        job.overhead_s + extra_overhead_s,
        job.done_s,
        job.attempt,
        job.milli,
    )


def work_s(job: Job, now: float) -> float:
    """Training progress of the current attempt at ``now`` (seconds of work past its overhead)."""
    assert job.started_s is not None, f"{job.job_id} is not running"
    return max(0.0, now - job.started_s - job.overhead_s)


def at_risk_s(job: Job, now: float) -> float:
    """Work a preemption at ``now`` would lose: the progress since the attempt's last checkpoint.

    Attempts resume from a checkpoint, so checkpoints fall every ``checkpoint_every_s`` of the
    attempt's own work.
    """
    w = work_s(job, now)
    return w % job.checkpoint_every_s if job.checkpoint_every_s else w


def requeued(job: Job, now: float, restart_cost_s: float) -> Job:
    """The job back in the queue after a preemption at ``now``: its durable work kept, the rest lost."""
    durable = work_s(job, now) - at_risk_s(job, now)
    return dataclasses.replace(
        job, started_s=None, nodes=(), overhead_s=restart_cost_s, done_s=job.done_s + durable, attempt=job.attempt + 1
    )
