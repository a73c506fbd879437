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
from traingate.supervision.attempts import Attempt
from traingate.supervision.checkpoints import latest_checkpoint
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

    A smoke stage of a recipe proves the wiring end to end: it stops half way at a checkpoint, then
    resumes and finishes. The first half's supervision is appended to ``before`` (it is charged too).
    A smoke stage interrupted before it saved a checkpoint (a budget's pause that reached it during start-up
    on a busy machine) resumes into the same two halves: its first half continues ``previous``.
    """
    if job.stage == "smoke" and not job.is_script and (half := _half_way_ahead(job, previous)) is not None:
        info(f"smoke: part 1 stops at step {half} with a checkpoint; part 2 resumes from it")
        first = supervise(dataclasses.replace(job, stop_at_step=half), hooks, resumed=previous, zygote=zygote)
        if first.status != Status.COMPLETED:
            return first
        first_half = outcomes.charged_attempts(job, first)  # ``previous``'s attempts, then its own
        earlier = first_half[: len(first_half) - len(first.attempts)]
        # The second half's supervisor.json holds only its own attempts: the first half's charge (with
        # ``previous``'s) stays in charged.json, so `traingate watch` and the run's budget keep counting it.
        charged.record(Path(job.stage_dir), [a.to_record() for a in first_half], final=False)
        if job.budget_usd is not None:  # the second half's budget counts what the first half held
            # spent_before_usd already holds ``previous``'s attempts (the run's charged stages).
            own = total_usd(first_half[len(earlier) :])
            job = dataclasses.replace(job, spent_before_usd=job.spent_before_usd + own)
        if earlier:  # charged with the stage's result as well
            state = files.read_supervisor_state(Path(job.stage_dir))
            kept = state.attempts[: len(earlier)] if state is not None else []
            first = dataclasses.replace(first, attempts=[*map(Attempt.from_record, kept), *first.attempts])
        before.append(first)
        if zygote is not None and not zygote.shared:
            zygote = None  # the first half's supervision stopped it
        previous = None
    return supervise(job, hooks, resumed=previous, zygote=zygote)


def _half_way_ahead(job: StageJob, previous: files.SupervisorState | None) -> int | None:
    """The smoke stage's half-way step when its first half is still to run: a fresh stage, or a resumed one
    that left no checkpoint past step 0 (resumed from step 0 it would prove no resume). None: the resume
    continues from its checkpoint, which is a resume already (its earlier launches stay in its record)."""
    half = max(1, job.max_steps // 2)
    if previous is None:
        return half
    step, _ = latest_checkpoint(job.checkpoint_uri)
    return half if not step else None
