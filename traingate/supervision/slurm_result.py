"""After a Slurm job ended for good: what it means for the stage, from sacct's ending and what the batch
step's supervisor left in the stage directory.

One pure decision, :func:`after_end`: report the supervisor's verdict, or submit the stage again from its
checkpoint (a job preempted without requeue, a node lost after Slurm gave up requeueing it), or report
what Slurm did when the supervisor could not (cancelled, timed out, the batch step crashed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from traingate.capacity.slurm import SIGNALLED, AccountedJob, Ending, ending
from traingate.job import files
from traingate.job.stagejob import StageJob
from traingate.job.vocab import Cause, Status
from traingate.launch.proc import ProcResult
from traingate.supervision.supervisor import TAIL_LINES, Attempt, Supervision


@dataclass(frozen=True)
class AfterEnd:
    sup: Supervision | None  # what to report (None: resubmit)
    resubmit: bool
    why: str  # one line for the log


def _tail(stage_dir: Path, job_id: str) -> list[str]:
    lines: list[str] = []
    for name in (files.STDOUT, f"slurm-{job_id}.out"):
        p = stage_dir / name
        if p.exists():
            lines += p.read_text(errors="replace").splitlines()[-TAIL_LINES:]
    return lines[-TAIL_LINES:]


def supervision_of(
    job: StageJob,
    state: files.SupervisorState | None,
    acct: AccountedJob,
    *,
    status: Status | None = None,
    cause: Cause | None = None,
    error: str | None = None,
) -> Supervision:
    """The batch step's supervision as the local engine's launch task would have it (attempts, verdict,
    last log lines); ``status``/``cause``/``error`` override the verdict where Slurm's ending decides."""
    final = (state.final if state else None) or {}
    recorded = state.attempts if state else []
    attempts = [Attempt.from_record(a) for a in recorded]
    proc = ProcResult(
        returncode=acct.exit_code if acct.exit_code is not None else -(acct.signal or 0),
        duration_s=float(acct.elapsed_s or 0),
        tail=_tail(Path(job.stage_dir), acct.job_id),
    )
    st = status or (Status(final["status"]) if final.get("status") else Status.FAILED)
    c = cause if status is not None else (Cause(final["cause"]) if final.get("cause") else None)
    return Supervision(
        st,
        c,
        error if status is not None else final.get("error"),
        attempts,
        proc,
        final.get("stop_reason"),
        job,
        None if status is not None else final.get("paused_by"),
        None if status is not None else final.get("checkpointed"),
    )


def after_end(
    job: StageJob, acct: AccountedJob, state: files.SupervisorState | None, stopped_by_us: bool, launched: bool
) -> AfterEnd:
    """What a final Slurm ending means. ``stopped_by_us``: traingate signalled or cancelled the job (a flow
    run cancelled); ``launched``: the batch step started in this job (else it never left the queue)."""
    end = _ending(acct)
    final = state.final_status if state is not None else None
    jid = acct.job_id
    resume = f"continue with `traingate resume {job.run_id}`"
    if end == Ending.CANCELLED:
        who = "traingate (the flow run was cancelled)" if stopped_by_us else "scancel outside traingate (an admin)"
        if launched:
            written = "written" if final == Status.PREEMPTED else "not confirmed"
            seen, error = state, f"Slurm job {jid} cancelled by {who}; emergency checkpoint {written}; {resume}"
            note = f"cancelled by {who}"
        else:
            seen, error = None, f"Slurm job {jid} cancelled by {who} before it started; {resume}"
            note = f"cancelled by {who} while pending"
        return AfterEnd(
            supervision_of(job, seen, acct, status=Status.PREEMPTED, cause=Cause.PREEMPTED, error=error), False, note
        )
    last = (state.final if state is not None else None) or {}
    signalled = final == Status.PREEMPTED and str(last.get("stop_reason") or "").startswith(SIGNALLED)
    if end == Ending.PREEMPTED or (signalled and launched and not stopped_by_us):
        # PreemptMode=CANCEL (or a requeue that did not happen): the checkpoint is on disk; submit again.
        # A stage an alert paused stays paused: its stop reason is the alert's, not Slurm's signal.
        return AfterEnd(
            None,
            True,
            f"Slurm job {jid} preempted without requeue ({acct.state}): submitting the stage "
            "again, it resumes from its checkpoint",
        )
    if end == Ending.NODE_LOST:
        return AfterEnd(
            None,
            True,
            f"Slurm job {jid} lost a node ({acct.state}) and was not requeued: submitting "
            "the stage again, it resumes from its checkpoint",
        )
    if end == Ending.TIMEOUT:
        return AfterEnd(
            supervision_of(
                job,
                state,
                acct,
                status=Status.FAILED,
                cause=Cause.TIMEOUT,
                error=f"{Cause.TIMEOUT}: Slurm job {jid} reached its --time limit "
                f"({acct.state}); the canary's estimate was too low or the stage "
                f"slowed down; raise stages.{job.stage}.timeout_s or {resume}",
            ),
            False,
            "time limit",
        )
    if end == Ending.OOM:
        return AfterEnd(
            supervision_of(
                job,
                state,
                acct,
                status=Status.FAILED,
                cause=Cause.OOM,
                error=f"{Cause.OOM}: Slurm job {jid} exceeded its memory allocation",
            ),
            False,
            "out of memory",
        )
    if final is not None:
        return AfterEnd(supervision_of(job, state, acct), False, f"supervisor verdict: {final}")
    return AfterEnd(
        supervision_of(
            job,
            state,
            acct,
            status=Status.FAILED,
            cause=Cause.USER_ERROR,
            error=f"{Cause.USER_ERROR}: Slurm job {jid} ended {acct.state} (exit code "
            f"{acct.exit_code}) without a supervisor verdict; see "
            f"{Path(job.stage_dir) / f'slurm-{jid}.out'}",
        ),
        False,
        "no verdict",
    )


def _ending(acct: AccountedJob) -> Ending:
    e = ending(acct.state)
    assert e is not None, f"after_end called on a live state {acct.state}"
    return e
