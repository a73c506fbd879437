"""One stage's supervised training, as every engine runs it: the smoke stage's two halves, else one supervision.

The local engine calls it in the launch task; the Slurm engine in the job's batch step
(:mod:`traingate.ladder.slurm_batch`). Same function, so a stage trains the same way on both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from traingate.cost import charged
from traingate.cost.ledger import total_usd
from traingate.job import files
from traingate.job.stagejob import StageJob
from traingate.job.vocab import Status
from traingate.ladder import outcomes
from traingate.runtime.warm import Zygote
from traingate.supervision.supervisor import Hooks, Supervision, supervise


def train(
    job: StageJob,
    hooks: Hooks,
    previous: files.SupervisorState | None,
    info: Callable[[str], None],
    before: list[Supervision],
    zygote: Zygote | None = None,
) -> Supervision:
    """Supervise ``job`` to its end; ``previous``: an interrupted supervision of it to resume; ``zygote``: one
    started for it ahead of time (its first supervision takes it over).

    A fresh smoke stage of a recipe proves the wiring end to end: it stops half way at a checkpoint,
    then resumes and finishes. The first half's supervision is appended to ``before`` (it is charged too).
    """
    if job.stage == "smoke" and not job.is_script and previous is None:
        half = max(1, job.max_steps // 2)
        info(f"smoke: part 1 stops at step {half} with a checkpoint; part 2 resumes from it")
        first = supervise(dataclasses.replace(job, stop_at_step=half), hooks, zygote=zygote)
        if first.status != Status.COMPLETED:
            return first
        before.append(first)
        first_half = outcomes.charged_attempts(job, first)
        # The second half's supervisor.json holds only its own attempts: the first half's charge stays in
        # charged.json, so `traingate watch` and the run's budget keep counting it.
        charged.record(Path(job.stage_dir), [a.to_record() for a in first_half], final=False)
        if job.budget_usd is not None:  # the second half's budget counts what the first half held
            job = dataclasses.replace(job, spent_before_usd=job.spent_before_usd + total_usd(first_half))
        zygote = None  # the first half's supervision stopped it
    return supervise(job, hooks, resumed=previous, zygote=zygote)
