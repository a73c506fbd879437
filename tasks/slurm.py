"""The Slurm engine's side-effect boundary: submit a stage attempt, follow it to its end, cancel it.

Called by the launch task (``tasks/train.py``) for a pool with ``engine: slurm``. Slurm schedules
(gang, QOS priority, account quotas, fair share, backfill, preemption); this follows what it does:

- submit: ``sbatch`` (the mapping in :mod:`traingate.capacity.slurm`); the job id goes to the stage
  directory (``slurm.json``), the stage's MLflow run (tag ``traingate.slurm_job_id``) and the result's
  metrics. A stage whose recorded job is still live in Slurm is followed, never submitted twice (an
  orchestrator that died and came back finds its job);
- follow: squeue while the job lives (pending reason and Slurm's start estimate logged when they
  change), then sacct for its final state; a job seen COMPLETING, PREEMPTED or NODE_FAIL may come back
  requeued, so only a job squeue no longer shows live is final. While the controller does not answer
  (restarted, unreachable) the commands are retried until it does;
- cancel: a cancelled flow run writes ``slurm_stop`` and SIGTERMs the batch step (emergency
  checkpoint, no requeue); a job still pending is just cancelled. An admin's ``scancel`` ends the
  stage as cancelled (resumable), not failed and not retried;
- preempted without requeue (``PreemptMode=CANCEL``) or a node lost for good: submitted again, it
  resumes from its checkpoint, within ``supervision.max_restarts``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from traingate.capacity import slurm, slurm_cli
from traingate.capacity.pools import PoolConfig
from traingate.capacity.slurm_cli import Unreachable
from traingate.cost import charged as charged_file
from traingate.cost import ledger, slurm_cost
from traingate.job import files
from traingate.job.catalog import CheckpointCatalog
from traingate.job.result import StageResult
from traingate.job.stagejob import StageJob
from traingate.job.vocab import Cause, Status
from traingate.ladder import outcomes
from traingate.settings import Settings
from traingate.supervision import drivers
from traingate.supervision.slurm_result import after_end, supervision_of
from traingate.supervision.supervisor import canary_p99, read_state
from traingate.tracking import runs

POLL_S = 1.0
SETTLE_S = 10.0  # a job seen PREEMPTED/NODE_FAIL in squeue this long without a requeue is final
SAY_EVERY_S = 30.0  # a pending job's reason is logged when it changes, or this often


def run_on_slurm(
    job: StageJob, pool: PoolConfig, resume: bool, stopping: Callable[[], str | None], log: Any
) -> StageResult:
    """Train ``job`` as Slurm batch jobs (one at a time) until it ends; its StageResult."""
    assert pool.slurm is not None, "validated by PoolConfig"
    stage_dir = Path(job.stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / slurm.STOP_FILE).unlink(missing_ok=True)
    t0 = time.monotonic()
    record = _read_record(stage_dir)
    job_id = _live(record, log)
    resubmits, requeues, held_s, waited_s = 0, 0, 0.0, 0.0
    while True:
        if job_id is None:
            try:
                job_id = _submit(job, pool, resume or resubmits > 0 or bool(record.get("jobs")), record, log)
            except slurm.SlurmError as e:  # refused: nothing started, one line says what to change
                log.error("%s: %s", job.stage, e)
                return StageResult(
                    stage=job.stage,
                    status=Status.FAILED,
                    metrics={"restarts": resubmits},
                    duration_s=time.monotonic() - t0,
                    error=f"{Cause.USER_ERROR}: {e}",
                )
        try:
            followed = _follow(job, job_id, stopping, log)
        except slurm.NeverStarts as e:
            log.error("%s: %s", job.stage, e)
            return StageResult(
                stage=job.stage,
                status=Status.FAILED,
                metrics={"slurm_job_id": int(job_id)},
                duration_s=time.monotonic() - t0,
                error=f"{Cause.USER_ERROR}: {e}",
            )
        except BaseException:
            # The launch task itself is going away (its runner's SIGTERM): the job must not train on unwatched.
            _stop(job, job_id, None, "the launch task was interrupted", log)
            raise
        acct = _final(job_id, log)
        held_s += acct.elapsed_s or 0
        requeues += followed.requeues
        if followed.first_start is not None:
            waited_s += max(0.0, followed.first_start - record["jobs"][-1]["submitted"])
        state = read_state(stage_dir)
        after = after_end(job, acct, state, followed.stopped, followed.launched)
        log.info("%s: Slurm job %s ended %s: %s", job.stage, job_id, acct.state, after.why)
        if after.sup is not None:
            sup = after.sup
            break
        if (why := stopping()) is not None:
            sup = supervision_of(
                job,
                state,
                acct,
                status=Status.PREEMPTED,
                cause=Cause.PREEMPTED,
                error=f"{after.why}; not submitted again: {why}; continue with `traingate resume {job.run_id}`",
            )
            break
        if resubmits >= job.spec.supervision.max_restarts:
            sup = supervision_of(
                job,
                state,
                acct,
                status=Status.FAILED,
                cause=Cause.WORKER_LOST,
                error=f"{Cause.WORKER_LOST}: {after.why}; but the {resubmits} resubmits of "
                "supervision.max_restarts are spent",
            )
            break
        resubmits += 1
        job_id = None
    assert sup is not None
    result = outcomes.from_supervision(job, sup, held_s or (time.monotonic() - t0))
    # Charged from Slurm's accounting: every allocation of every job of the stage (a requeue's included).
    allocs = [a for jid in (j["id"] for j in record["jobs"]) for a in _allocations(jid, log)]
    if (warning := slurm_cost.untracked_gpus(allocs)) is not None:
        log.warning("%s: %s", job.stage, warning)
    charged = slurm_cost.charged(
        job.run_id,
        job.stage,
        job.pool,
        pool.price_per_gpu_hour,
        allocs,
        sup.status,
        job.slots,
        [dataclasses.asdict(a) for a in sup.attempts],
    )
    result.attempts = [a.to_record() for a in charged]
    result.cost_usd = ledger.total_usd(charged)
    files.write_json(stage_dir / slurm.RECORD_FILE, record)
    charged_file.record(stage_dir, result.attempts, final=True)  # what `traingate watch` adds up for the ended stage
    result.metrics.update(
        slurm_job_id=int(job_id), slurm_requeues=requeues, slurm_resubmits=resubmits, queue_wait_s=round(waited_s, 3)
    )
    result.details["slurm"] = {
        "jobs": [j["id"] for j in record["jobs"]],
        "state": acct.state,
        "nodes": acct.nodes,
        "partition": pool.slurm.partition,
    }
    if sup.error:
        log.error("%s: %s", job.stage, sup.error)
    return result


# ------------------------------------------------------------------------------------------ submit
def _read_record(stage_dir: Path) -> dict[str, Any]:
    return files.read_json(stage_dir / slurm.RECORD_FILE) or {"jobs": []}


def _live(record: dict[str, Any], log: Any) -> str | None:
    """The stage's last submitted job, when Slurm still has it live: follow it instead of submitting."""
    if not record.get("jobs"):
        return None
    jid = record["jobs"][-1]["id"]
    q = _retrying(lambda: slurm.queued_job(slurm_cli.squeue(), jid), log)
    if q is not None and slurm.ending(q.state) is None:
        log.info("Slurm job %s of this stage is still %s: following it, not submitting another", jid, q.state)
        return jid
    return None


def _submit(job: StageJob, pool: PoolConfig, resume: bool, record: dict[str, Any], log: Any) -> str:
    stage_dir = Path(job.stage_dir)
    assert pool.slurm is not None
    done = 0
    if resume:
        steps = CheckpointCatalog(job.checkpoint_uri).list_steps()
        done = steps[-1] if steps else 0
    partition = pool.slurm.partition
    max_time = _retrying(lambda: slurm_cli.partition_max_time(partition), log)
    limit = slurm.time_limit_s(job, canary_p99(stage_dir), done, max_time)
    files.write_json(stage_dir / slurm.JOB_FILE, job.to_dict())
    cmd = slurm.sbatch_command(
        job,
        pool.slurm,
        python=sys.executable,
        time_limit_s=limit,
        grace_s=job.spec.supervision.preempt_grace_s,
        resume=resume,
        zygote_log=str(stage_dir / drivers.ZYGOTE_LOG) if drivers.starts_warm(job) else None,
    )
    # sbatch is not idempotent: an unanswering controller may still have queued the job, so a retry
    # looks for it by name first.
    while True:
        try:
            jid = slurm_cli.submit(cmd, job, pool.slurm)
            break
        except Unreachable as e:
            log.warning("%s: sbatch: %s; retrying", job.stage, e)
            time.sleep(2.0)
            mine = [
                q
                for q in _retrying(lambda: slurm.queued_jobs(slurm_cli.squeue()), log)
                if q.name == slurm.job_name(job)
                and slurm.ending(q.state) is None
                and q.job_id not in {j["id"] for j in record["jobs"]}
            ]
            if mine:
                jid = mine[-1].job_id
                break
    record["jobs"].append({"id": jid, "submitted": time.time(), "resume": resume, "time_limit_s": limit})
    files.write_json(stage_dir / slurm.RECORD_FILE, record)
    log.info(
        "%s: submitted Slurm job %s (partition %s, %d node(s) x %s, account %s, QOS %s, --time %d min)",
        job.stage,
        jid,
        pool.slurm.partition,
        job.nodes,
        slurm.gres(pool.slurm, job.procs_per_node),
        job.team,
        job.priority,
        max(1, round(limit / 60)),
    )
    _tag(job, jid, log)
    return jid


def _tag(job: StageJob, jid: str, log: Any) -> None:
    if not job.tracking_uri or not job.mlflow_run_id:
        return
    try:
        runs.client(Settings.from_env().tracking_uri).set_tag(job.mlflow_run_id, "traingate.slurm_job_id", jid)
    except (MlflowException, OSError) as e:
        log.warning("Slurm job id %s not tagged on the MLflow run: %s", jid, e)


# ------------------------------------------------------------------------------------------ follow
def _retrying(call: Callable[[], Any], log: Any) -> Any:
    """``call()``, again every few seconds while the Slurm controller does not answer."""
    said = False
    while True:
        try:
            out = call()
            if said:
                log.info("Slurm controller answers again")
            return out
        except Unreachable as e:
            if not said:
                log.warning("Slurm controller unreachable (%s): retrying until it answers", e)
                said = True
            time.sleep(2.0)


@dataclass
class _Followed:
    stopped: bool = False  # traingate stopped it (a cancelled flow run)
    launched: bool = False  # its batch step started at least once
    requeues: int = 0  # how often Slurm put it back in the queue
    first_start: float | None = None


def _follow(job: StageJob, jid: str, stopping: Callable[[], str | None], log: Any) -> _Followed:
    """Until Slurm no longer has the job live."""
    f = _Followed()
    said, said_at, odd_since = "", 0.0, None
    while True:
        q = _retrying(lambda: slurm.queued_job(slurm_cli.squeue(), jid), log)
        if not f.stopped and (why := stopping()) is not None:
            f.stopped = True
            _stop(job, jid, q, why, log)
        now = time.time()
        if q is None:
            f.launched = f.launched or _ran(jid, log)
            return f
        f.requeues = max(f.requeues, q.restarts)
        if q.state in ("RUNNING", "COMPLETING") and f.first_start is None:
            f.first_start = float(q.start_time or now)
        f.launched = f.launched or q.state in ("RUNNING", "COMPLETING") or q.restarts > 0
        if q.pending and q.reason in slurm.NEVER_STARTS and not f.stopped:
            (Path(job.stage_dir) / slurm.STOP_FILE).write_text(f"{q.reason}\n")
            _retrying(lambda: slurm_cli.cancel(jid), log)
            raise slurm.NeverStarts(
                f"Slurm job {jid} can never start ({q.reason}): it asks for "
                f"{slurm.NEVER_STARTS[q.reason]}; cancelled it"
            )
        end = slurm.ending(q.state)
        if end is not None and q.state not in ("PREEMPTED", "NODE_FAIL", "BOOT_FAIL"):
            f.launched = f.launched or _ran(jid, log)
            return f
        if end is not None:  # may still be requeued
            odd_since = odd_since or now
            if now - odd_since >= SETTLE_S:
                f.launched = True
                return f
        else:
            odd_since = None
        line = slurm.describe_pending(q, now) if q.pending else f"Slurm job {jid} {q.state} on {q.nodes}"
        if q.restarts:
            line += f" (requeued {q.restarts}x)"
        head = line.split(", Slurm's estimate")[0]
        if head != said or (q.pending and now - said_at >= SAY_EVERY_S):
            log.info("%s: %s", job.stage, line)
            said, said_at = head, now
        time.sleep(POLL_S)


def _ran(jid: str, log: Any) -> bool:
    a = _retrying(lambda: slurm.accounted_job(slurm_cli.sacct(jid), jid), log)
    # A job cancelled while pending has a start time in sacct too (its end): only time held counts.
    return a is not None and (bool(a.elapsed_s) or a.restarts > 0)


def _stop(job: StageJob, jid: str, q: slurm.QueuedJob | None, why: str, log: Any) -> None:
    """A stop traingate asked for: the running batch step checkpoints and exits (no requeue); a pending job is
    cancelled."""
    (Path(job.stage_dir) / slurm.STOP_FILE).write_text(why + "\n")
    if q is None:
        q = _retrying(lambda: slurm.queued_job(slurm_cli.squeue(), jid), log)
    running = q is not None and q.state in ("RUNNING", "COMPLETING")
    log.info(
        "%s: %s: %s Slurm job %s", job.stage, why, "SIGTERM to the batch step of" if running else "cancelling", jid
    )
    try:
        _retrying(lambda: slurm_cli.cancel(jid, "TERM" if running else None), log)
    except slurm.SlurmError as e:  # it ended meanwhile
        log.info("%s: scancel %s: %s", job.stage, jid, e)


def _allocations(jid: str, log: Any) -> list[slurm_cost.Allocation]:
    """The ended job's allocations: ``sacct -D`` lists one record per allocation a requeue gave it (plain sacct
    shows only the newest)."""
    return _retrying(lambda: slurm_cost.allocations(slurm_cli.run(["sacct", "-D", "-j", jid, "--json"]), jid), log)


def _final(jid: str, log: Any) -> slurm.AccountedJob:
    """sacct's record of the ended job (it lags squeue by about a second)."""
    end = time.monotonic() + 60.0
    while True:
        a = _retrying(lambda: slurm.accounted_job(slurm_cli.sacct(jid), jid), log)
        if a is not None and slurm.ending(a.state) is not None:
            return a
        if time.monotonic() > end:
            raise slurm.SlurmError(
                f"Slurm job {jid} left the queue but sacct shows it {a.state if a else 'nowhere'} "
                "after 60 s; check slurmdbd (sacctmgr show cluster)"
            )
        time.sleep(0.5)
