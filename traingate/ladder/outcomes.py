"""Turn what a finished stage left behind into a StageResult. Plain functions of files and numbers."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from traingate.cost.ledger import Attempt, attempts_of, total_usd
from traingate.job import files, sizing
from traingate.job.result import NEXT_STAGE, PROFILE_METRICS, StageResult
from traingate.job.stagejob import StageJob
from traingate.job.vocab import Status
from traingate.launch.proc import ProcResult
from traingate.recipes.script import extract_metrics, series_of_attempts, summarize, unmatched
from traingate.spec import RunSpec
from traingate.supervision.supervisor import Supervision
from traingate.tracking import restarts as restart_record

NEXT = NEXT_STAGE
# The sizing profile's metrics a stage reports: the list validation checks gate rules against.
_PROFILE_KEYS = PROFILE_METRICS


def _estimate_next(spec: RunSpec, stage: str, profile: dict[str, float]) -> dict[str, float]:
    nxt = NEXT.get(stage)
    est = sizing.estimate_of(spec, nxt, profile) if nxt is not None else None
    if est is None:
        return {}
    return {
        "next_stage_wall_s": est["wall_s"],
        "next_stage_cost_usd": est["cost_usd"],
        "next_stage_slot_hours": est["slot_hours"],
    }


def _estimated_by_previous(job: StageJob) -> float | None:
    """What the stage before this one estimated this one would cost (its gate compared it with the
    budget): the same estimate, from its profile beside this stage, so actual and estimate can be compared."""
    prev = next((p for p, n in NEXT.items() if n == job.stage), None)
    data = files.read_result(Path(job.stage_dir).parent / prev) if prev and prev != "unit" else None
    profile = (data.metrics.get("profile") if data else None) or {}
    if prev is None or not profile.get("step_time_mean_s"):
        return None
    return _estimate_next(job.spec, prev, profile).get("next_stage_cost_usd")


def reestimated(result: StageResult, spec: RunSpec) -> StageResult:
    """``result`` with its estimate of the next stage made again for ``spec`` from the pace it measured: a
    resume that changes the next stage's steps, width or price changes what the gate compares with a budget.
    Unchanged when the stage estimated nothing."""
    profile = result.details.get("profile") or {k: v for k, v in result.metrics.items() if k in _PROFILE_KEYS}
    est = _estimate_next(spec, result.stage, profile) if result.estimate else {}
    return replace(result, estimate=est) if est else result


def charged_attempts(job: StageJob, sup: Supervision, before: Sequence[Supervision] = ()) -> list[Attempt]:
    """Every attempt this stage has made, charged at the job's pool, slots and price: ``before`` (earlier
    supervisions in this task: smoke's first half), the attempts of interrupted supervisions of the stage
    (a resume's, a requeue's: kept in supervisor.json), then ``sup``'s."""
    mine = [asdict(a) for a in sup.attempts]
    state = files.read_supervisor_state(Path(job.stage_dir))
    recorded = state.attempts if state is not None else []
    # supervisor.json ends with sup's own attempts; what precedes them is the earlier supervisions'.
    tail_matches = len(recorded) >= len(mine) and all(
        r.get("launched_at") == m["launched_at"] for r, m in zip(recorded[len(recorded) - len(mine) :], mine)
    )
    earlier = recorded[: len(recorded) - len(mine)] if tail_matches else []
    supervised = [*(asdict(a) for b in before for a in b.attempts), *earlier, *mine]
    return attempts_of(job.run_id, job.stage, supervised, job.pool, job.slots, job.price_per_slot_hour)


def from_supervision(
    job: StageJob, sup: Supervision, duration_s: float, before: Sequence[Supervision] = ()
) -> StageResult:
    """A stage's result: what the training process left (result.json, or a script's output) and how
    the supervisor saw it end. Cost is the ledger's charge of every attempt (:func:`charged_attempts`,
    :func:`traingate.cost.ledger.total_usd`): restarts, backoff and idle start-up are paid for, the time
    the task spent outside its attempts (recording, preflight) is not.

    ``before``: supervisions of this stage that ran earlier in the same task (smoke's first half,
    which stops at a checkpoint on purpose); their attempts are charged with the rest.
    """
    stage_dir = Path(job.stage_dir)
    status, error = sup.status, sup.error
    attempts = charged_attempts(job, sup, before)
    details: dict[str, Any] = {"log_tail": sup.proc.tail[-50:], "supervision": sup.to_dict(), "pid": sup.proc.pid}
    if job.is_script:
        s = job.spec.recipe.script
        assert s is not None
        log_text = (stage_dir / files.STDOUT).read_text(errors="replace") if (stage_dir / files.STDOUT).exists() else ""
        # Each point with the step it names and the time its line was read, over every attempt; the latest
        # attempt's values replace an earlier one's at the steps it ran again (its final value is the result).
        timed = series_of_attempts(files.read_script_points(stage_dir))
        if not timed:  # a stage directory from before the points file: its output, timed now
            now = time.time()
            timed = {k: [(step, v, now) for step, v in pts] for k, pts in extract_metrics(log_text, s.metrics).items()}
        series = {k: [(step, v) for step, v, _ in pts] for k, pts in timed.items()}
        metrics: dict[str, Any] = summarize(series) if series else {"nonfinite_steps": 0.0, "steps": 0.0}
        if s.metrics and not series and status == Status.COMPLETED:
            # Exit 0 without one matched line: nothing was measured, so no gate may pass it on zero steps.
            status, error = Status.FAILED, unmatched(s.metrics, log_text)
        steps = metrics.get("steps", 0)
        profile = {"step_time_mean_s": sup.proc.duration_s / steps} if steps else {}
        # Reported like a built-in recipe's profile: a later `traingate run --dry-run` estimates from it.
        metrics.update(profile)
        details.update(series={k: v[-200:] for k, v in timed.items()})
        # A script's checkpoints are traingate's only when it declares them (indexed and published there).
        checkpoint_uri = job.checkpoint_uri if s.checkpoints is not None else None
    else:
        data = files.read_result(stage_dir)
        metrics = dict(data.metrics) if data else {}
        profile = metrics.pop("profile", {}) or {}
        details.update(
            eval=metrics.pop("eval", {}) or {}, checkpoint_blocked_s=data.checkpoint_blocked_s if data else None
        )
        metrics.update({k: profile[k] for k in _PROFILE_KEYS if k in profile})
        checkpoint_uri = data.checkpoint_uri if data else None
        details["profile"] = profile
    metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    details["restarts"] = restart_records(job, sup)
    metrics["restarts"] = len(details["restarts"])
    completed = status == Status.COMPLETED
    return StageResult(
        stage=job.stage,
        status=status,
        metrics=metrics,
        cost_usd=total_usd(attempts),
        duration_s=duration_s,
        checkpoint_uri=checkpoint_uri,
        estimate=_estimate_next(job.spec, job.stage, profile) if completed else {},
        details=details,
        error=error,
        attempts=[a.to_record() for a in attempts],
        estimated_cost_usd=_estimated_by_previous(job),
    )


def restart_records(job: StageJob, sup: Supervision) -> list[dict[str, str]]:
    """This stage's restarts after a failure or a preemption, over every process that trained it (a
    resume's earlier ones included): the supervisor's record in the stage directory, which `traingate
    watch` reads while the stage runs and the stage's MLflow run is tagged with
    (:mod:`traingate.tracking.restarts`).
    """
    state = files.read_supervisor_state(Path(job.stage_dir))
    attempts = state.attempts if state is not None else [asdict(a) for a in sup.attempts]
    return restart_record.records(attempts, final=True)


def resumable_stop(stage: str, result: StageResult, run_id: str) -> str:
    """How a stage that stopped at a checkpoint, resumable, reads in the ladder's final state: a pause (an
    alert, a budget's alert among them, or a full disk) names who paused it and why, with its supervisor's
    words; anything else (Ctrl-C, a cancelled flow run, a higher priority class) was preempted.

    >>> paused = StageResult(stage="smoke", status=Status.PREEMPTED, error="paused by alert loss-spike: loss 9 "
    ...     "> 4x median; continue with `traingate resume r1`",
    ...     details={"supervision": {"paused_by": "alert loss-spike"}})
    >>> resumable_stop("smoke", paused, "r1")
    'smoke paused by alert loss-spike: loss 9 > 4x median; continue with `traingate resume r1`'
    >>> resumable_stop("smoke", StageResult(stage="smoke", status=Status.PREEMPTED, error="preempted: SIGINT"), "r1")
    'smoke preempted at a checkpoint; continue with: traingate resume r1'

    A preemption whose emergency checkpoint was not confirmed (a script that does not checkpoint on SIGTERM) says so:
    the resume goes on from the newest checkpoint the stage wrote before.

    >>> unconfirmed = StageResult(stage="smoke", status=Status.PREEMPTED, error="preempted: SIGINT",
    ...     details={"supervision": {"checkpointed": False}})
    >>> print(resumable_stop("smoke", unconfirmed, "r1").replace("; ", ";\\n"))
    smoke preempted, its emergency checkpoint not confirmed (it resumes from its latest checkpoint);
    continue with: traingate resume r1
    """
    supervision = result.details.get("supervision", {})
    if supervision.get("paused_by") and result.error:
        return f"{stage} {result.error}"
    if supervision.get("checkpointed") is False:
        return (
            f"{stage} preempted, its emergency checkpoint not confirmed (it resumes from its latest checkpoint); "
            f"continue with: traingate resume {run_id}"
        )
    return f"{stage} preempted at a checkpoint; continue with: traingate resume {run_id}"


def from_pytest(proc: ProcResult, junit_path: Path, duration_s: float) -> StageResult:
    """The unit stage: counts from pytest's JUnit XML."""
    passed = failed = skipped = 0
    failures: list[str] = []
    if junit_path.exists():
        root = ET.parse(junit_path).getroot()
        for case in root.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                failed += 1
                failures.append(
                    f"{case.get('name')}: "
                    f"{(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}"
                )
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
    # pytest: 0 all passed, 1 some failed, 5 none collected; anything else means it could not run.
    ran = proc.returncode in (0, 1, 5)
    status = Status.COMPLETED if ran else Status.FAILED
    error = None if ran else f"pytest exit code {proc.returncode}: {' | '.join(proc.tail[-3:])}"
    return StageResult(
        stage="unit",
        status=status,
        metrics={"tests_passed": passed, "tests_failed": failed, "tests_skipped": skipped},
        duration_s=duration_s,
        details={"failures": failures, "log_tail": proc.tail[-50:]},
        error=error,
    )
