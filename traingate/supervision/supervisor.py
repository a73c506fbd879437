"""The restart loop around one training process tree: the one launch path of every StageJob.

Launch the tree, watch its heartbeats, classify how it ended, and either finish, stop with the cause, or relaunch
it from the latest checkpoint after a backoff, within the retry budget. Ladder stages, resumes, sweep trials and
drills all come through here. Prefect stays outside: the caller hands in plain callables (log a line, emit a
restart event, "should this tree stop now?").

A torchrun group may also restart *in place* after a lost worker (``--max-restarts`` set to what is left of the
budget): no backoff, no new agent, faster than a relaunch. The supervisor sees it in the heartbeats (their
``restart_count``), records it as an attempt, emits the same restart event and charges the same budget. Failures
an in-place restart cannot fix (a bug, NaN, an OOM that needs a smaller batch, a full disk) stop the tree at once,
so torchrun does not retry them, and the supervisor decides.

What differs between a built-in recipe and a user's script sits behind one interface
(:mod:`traingate.supervision.drivers`); the tick-by-tick watch of a launch is
:mod:`traingate.supervision.watch`, the alerts' actions :mod:`traingate.supervision.alerting`, the
records :mod:`traingate.supervision.attempts`. Each launch writes the attempt's StageJob
(``job.json``) into the stage directory; the attempts are kept in ``supervisor.json``
(:mod:`traingate.job.files`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from traingate.alerts.rules import Action
from traingate.job import envvars, files
from traingate.job.stagejob import StageJob
from traingate.job.vocab import Cause, Status, status_for
from traingate.launch import command, proc
from traingate.runtime import warm
from traingate.spec import RunSpec
from traingate.supervision import causes, heartbeat, oom
from traingate.supervision.alerting import roll_back
from traingate.supervision.attempts import (
    TAIL_LINES,
    Attempt,
    Hooks,
    Record,
    Supervision,
    earlier_attempts,
    read_state,
)
from traingate.supervision.backoff import Backoff, RetryBudget
from traingate.supervision.checkpoints import disk_full_detail, is_disk_full
from traingate.supervision.drivers import RecipeDriver, driver_for, start_zygote
from traingate.supervision.watch import Watch

# The supervisor's interface: what callers import from here.
__all__ = [
    "TAIL_LINES",
    "Attempt",
    "Hooks",
    "Supervision",
    "canary_p99",
    "disk_full_detail",
    "read_state",
    "request_stop",
    "stop_request",
    "supervise",
]

TICK_S = 0.2
_interrupt: list[str] = []  # set from a signal handler (Ctrl-C): every running supervision preempts its tree


def request_stop(reason: str) -> None:
    """Ask every supervision in this process to preempt its tree (checkpoint, stop, no restart)."""
    _interrupt.append(reason)


def stop_request() -> str | None:
    return _interrupt[0] if _interrupt else None


def canary_p99(stage_dir: Path) -> float | None:
    """The canary's p99 step time, when this stage's run has a finished canary beside it."""
    result = files.read_result(stage_dir.parent / "canary")
    profile = (result.metrics.get("profile") if result else None) or {}
    return profile.get("step_time_p99_s") or None


def supervise(
    job: StageJob,
    hooks: Hooks | None = None,
    python: str = sys.executable,
    seed: int | None = None,
    resumed: files.SupervisorState | None = None,
    zygote: warm.Zygote | None = None,
) -> Supervision:
    """Run one StageJob to its end under supervision (see the module docstring).

    ``resumed``: the state of an earlier, interrupted supervision of this stage; its attempts
    count, and the first launch here is a restart after its last one. ``zygote``: one
    :func:`start_zygote` started for it ahead of time (stopped with the stage, as one started here, unless
    it is the run's shared one).
    """
    hooks = hooks or Hooks()
    driver = driver_for(job)
    # supervision.warm_restarts: one pre-imported zygote forks every worker of this stage's launches
    # (traingate.runtime.warm); it is this process's child, so it dies with the stage (or, shared, the run).
    if job.spec.warm_restarts and (why := driver.cold_start_reason(job)) is not None:
        if job.spec.supervision.warm_restarts:  # asked for, not the CPU pool's default
            hooks.info(f"{job.stage}: supervision.warm_restarts has no effect on {why}; starting it cold")
        if zygote is not None:
            zygote.release()
            zygote = None
    elif not job.spec.warm_restarts:
        if zygote is not None:
            zygote.release()
            zygote = None
    elif zygote is None:
        zygote = start_zygote(job, python)
    # Rank 0's tracking journal is delivered here: the training processes then only journal.
    delivery = driver.delivery(job)
    if delivery is not None:
        job = dataclasses.replace(job, tracking_delivery="supervisor")
    try:
        return _supervise(_Run(job, hooks, driver, seed, resumed), python, zygote.socket if zygote else None)
    finally:
        if zygote is not None and (off := zygote.release()) is not None:
            hooks.info(f"{job.stage}: warm restarts were off (workers started cold): {off}")
        if delivery is not None:
            # Everything the stage logged is in MLflow before its result is read; what an outage kept
            # back stays in the journal for the next process of the stage or `traingate resume`.
            delivery.close()


def _supervise(run: _Run, python: str, zygote_socket: str | None) -> Supervision:
    """Launch, wait, judge; then finish, stop, or restart after a backoff."""
    while True:
        tree, watch = run.launch(python, zygote_socket)
        result = run.wait(tree, watch)
        if run.hooks.on_exit is not None:
            run.hooks.on_exit()
        attempt, words = watch.close(result.returncode)
        if watch.rollback is not None:
            run.roll_back(watch, attempt)
            continue
        verdict = run.judge(result, words, watch, attempt)
        if (ended := run.ended(verdict, result, watch)) is not None:
            return ended
        if (stopped := run.restart(verdict, result, watch, attempt)) is not None:
            return stopped


class _Tree(proc.ProcessTree):
    """A launch's process tree whose deliberate stops are marked in the stage directory before the SIGTERM:
    its agent then shuts the group down instead of restarting it in place (traingate.runtime.agent), which
    it does for a SIGTERM nobody here sent (a preemption of the group)."""

    def __init__(self, stage_dir: Path, *args: Any):
        self.stage_dir = stage_dir
        super().__init__(*args)

    def stop(self, grace_s: float = 30.0) -> None:
        # A stage directory that cannot take the mark (a full disk) is caught by the watch, which kills the tree.
        with contextlib.suppress(OSError):
            files.write_stop(self.stage_dir, "stopped by its supervisor")
        super().stop(grace_s)


class _Run:
    """One supervision's state across its launches: the job of the next launch, the attempts, the budget."""

    def __init__(
        self,
        job: StageJob,
        hooks: Hooks,
        driver: RecipeDriver,
        seed: int | None,
        resumed: files.SupervisorState | None,
    ):
        self.hooks, self.driver = hooks, driver
        sup = job.spec.supervision
        self.stage_dir = Path(job.stage_dir)
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        self.hang_s = sup.hang_timeout_s or heartbeat.hang_timeout(canary_p99(self.stage_dir), sup.hang_floor_s)
        self.backoff = Backoff(sup.backoff_base_s, 2.0, sup.backoff_max_s, jitter=0.5)
        self.budget = RetryBudget(sup.max_restarts, sup.max_downtime_s)
        self.rng = random.Random(seed)
        self.deadline = time.monotonic() + job.timeout_s
        self.earlier = earlier_attempts(self.stage_dir, resumed)
        self.record = Record(job, self.earlier)
        self.attempts: list[Attempt] = []
        self.overrides: list[str] = []
        self.stalled = -1  # consecutive failed launches that trained no step (after the first failure: 0)
        if self.earlier and job.attempt == 0:
            last = self.earlier[-1]
            job = dataclasses.replace(
                job,
                attempt=len(self.earlier),
                restart_cause=Cause(last.get("cause") or Cause.PREEMPTED),
                restart_fault_ts=last.get("ended_at"),
            )
        self.job = job
        self.record.write(self.attempts)
        hooks.info(f"{job.stage}: supervised: hang timeout {self.hang_s:.1f} s, up to {sup.max_restarts} restarts")
        self.started = time.time()
        self.monitor = driver.monitor(job, self.started)

    def launch(self, python: str, zygote_socket: str | None) -> tuple[proc.ProcessTree, Watch]:
        """Start the next launch, its attempt written to supervisor.json first."""
        files.clear_launch_files(self.stage_dir)
        left = self.budget.max_restarts - self.budget.restarts
        job = self.job = self.driver.launch(self.job, time.time(), left, self.hooks)
        job.write()
        env = envvars.job_environment(job)
        cmd = command.stage_command(job, python, zygote_socket)
        resume_step, unknown = self.driver.resume_point(job)
        attempt = Attempt(
            len(self.attempts),
            job.launched_at or time.time(),
            overrides=list(self.overrides),
            command=list(cmd),
            resume_from_step=resume_step,
            resume_step_unknown=unknown,
        )
        self.attempts.append(attempt)
        self.record.write(self.attempts)  # before the launch: a supervisor killed from here on leaves this attempt open
        self.hooks.info(f"{job.stage}: launch {len(self.attempts)}: {' '.join(cmd)}")
        watch = self.driver.watch(
            job, self.hang_s, self.attempts, self.budget, self.hooks, self.record, self.monitor, self.started
        )
        out, on_line = self.stage_dir / files.STDOUT, watch.line_hook(self.hooks.on_line)
        return _Tree(self.stage_dir, cmd, env, self.driver.workdir(job), out, on_line, TAIL_LINES), watch

    def wait(self, tree: proc.ProcessTree, watch: Watch) -> proc.ProcResult:
        grace_s = self.job.spec.supervision.preempt_grace_s
        remaining = max(1.0, self.deadline - time.monotonic())
        try:
            return tree.wait(
                timeout_s=remaining, grace_s=grace_s, tick=functools.partial(watch.tick, tree), tick_every_s=TICK_S
            )
        except BaseException:
            # The supervisor itself is going away (a runner's SIGTERM on cancel, Ctrl-C): the tree lives
            # in sessions of its own and would outlive us, so preempt it first.
            self.hooks.info(f"{self.job.stage}: supervisor interrupted: SIGTERM to the tree, {grace_s:.0f} s grace")
            tree.stop(grace_s)
            raise

    def roll_back(self, watch: Watch, attempt: Attempt) -> None:
        assert watch.rollback is not None
        self.job = roll_back(self.job, watch.rollback, attempt, self.hooks, self.monitor)
        self.record.write(self.attempts)

    def judge(
        self, result: proc.ProcResult, words: list[files.LastWords], watch: Watch, attempt: Attempt
    ) -> causes.Classification:
        """How the launch ended, recorded on its attempt."""
        job = self.job
        runtime = files.read_result(self.stage_dir)
        oom_retry = (
            job.spec.supervision.oom_halve_batch
            and oom.smaller_micro_batch(job.spec.optim.batch_size, job.spec.optim.grad_accum) is not None
        )
        ranks = self.driver.ranks(job)
        verdict = causes.classify(
            causes.Evidence(
                returncode=result.returncode,
                result_status=runtime.status if runtime else None,
                last_words=words,
                log_tail=result.tail,
                hang_detected=watch.hang is not None,
                stop_requested=watch.stop is not None,
                timed_out=result.timed_out,
                world_size=ranks,
                writes_result=ranks is not None,
            ),
            oom_retry=oom_retry,
        )
        if not verdict.completed and (
            verdict.cause == Cause.DISK_FULL or is_disk_full(result.log_error) or watch.disk_full is not None
        ):
            verdict = causes.Classification(Cause.DISK_FULL, False, disk_full_detail(job))
        attempt.cause, attempt.retryable = verdict.cause, verdict.retryable
        attempt.detail = watch.hang if verdict.cause == Cause.HANG and watch.hang else verdict.detail
        self.record.write(self.attempts)
        return verdict

    def ended(self, verdict: causes.Classification, result: proc.ProcResult, watch: Watch) -> Supervision | None:
        """The supervision's end when the launch completed, was stopped, or failed for good; None: restart it."""
        job = self.job
        unpublished = self.driver.publish(job, self.hooks)
        if verdict.completed and unpublished is not None:
            err = f"{Cause.TRANSIENT_IO}: the script finished, but {unpublished}"
            return self.finish(result, Status.FAILED, err, None, Cause.TRANSIENT_IO)
        if verdict.completed:
            return self.finish(result, Status.COMPLETED, None, None, None)
        if watch.stop is not None and watch.alert_stop is not None and watch.alert_stop.action == Action.STOP:
            err = f"stopped by alert {watch.stop}"
            return self.finish(result, Status.FAILED, err, watch.stop, Cause.ALERT)
        if watch.stop is not None:
            # Stopped from outside (or paused by an alert): leave the checkpoint for a resume, do not restart.
            checkpointed = verdict.cause == Cause.PREEMPTED and not verdict.not_checkpointed
            written = "written" if checkpointed else "NOT confirmed"
            how = "paused by alert" if watch.alert_stop is not None else "preempted:"
            err = (
                f"{how} {watch.stop}; emergency checkpoint {written} ({verdict.detail}); "
                f"continue with `traingate resume {job.run_id}`"
            )
            paused_by = f"alert {watch.alert_stop.rule}" if watch.alert_stop is not None else None
            return self.finish(result, Status.PREEMPTED, err, watch.stop, Cause.PREEMPTED, paused_by, checkpointed)
        if verdict.cause == Cause.DISK_FULL:
            # A full disk stays full until someone frees it: a restart cannot help, and the work saved so far
            # is good. The stage pauses, as a budget or an alert pauses it: resumable from its latest checkpoint.
            err = f"{Cause.DISK_FULL}: paused by the supervisor: {self.attempts[-1].detail}"
            return self.finish(result, Status.PREEMPTED, err, "disk full", Cause.DISK_FULL, "disk full")
        if not verdict.retryable:
            error = _stop_error(verdict.cause, self.attempts[-1].detail, result)
            return self.finish(result, status_for(verdict.cause), error, None, verdict.cause)
        return None

    def restart(
        self, verdict: causes.Classification, result: proc.ProcResult, watch: Watch, attempt: Attempt
    ) -> Supervision | None:
        """Back off and set up the next launch, within the budget and the stage's time; a Supervision: it ends."""
        stage, status = self.job.stage, status_for(verdict.cause)
        assert verdict.cause is not None, "a retried attempt has a cause"
        assert attempt.ended_at is not None, "a closed attempt has its end"
        # Back off exponentially over failures that made no progress (a crash loop); a launch that
        # trained before it failed (a node lost hours in) restarts after the base delay.
        progressed = attempt.end_step is not None and attempt.end_step > (attempt.start_step or 0)
        self.stalled = 0 if progressed else self.stalled + 1
        delay = self.backoff.delay(self.stalled, self.rng)
        cost = attempt.ended_at - attempt.launched_at + delay
        if not self.budget.allows(cost):
            err = _stop_error(verdict.cause, f"{attempt.detail}; {self.budget.why_not(cost)}", result)
            return self.finish(result, status, err, None, verdict.cause)
        if time.monotonic() + delay >= self.deadline:
            err = _stop_error(verdict.cause, f"{attempt.detail}; no time left in stages.{stage}.timeout_s", result)
            return self.finish(result, status, err, None, verdict.cause)
        spec = self._oom_policy() if verdict.cause == Cause.OOM else None
        attempt.backoff_s = delay
        watch.restarted(attempt, verdict.cause, len(self.earlier) + len(self.attempts), delay, self.overrides)
        self.record.write(self.attempts)
        self.budget.charge(cost)
        self.job = self.job.next_attempt(verdict.cause, attempt.ended_at, spec)
        if (why := _sleep(delay, self.hooks.stop_requested)) is not None:
            return self.finish(
                result,
                Status.PREEMPTED,
                f"preempted: {why} while waiting to restart after {verdict.cause}; continue with "
                f"`traingate resume {self.job.run_id}`",
                why,
                Cause.PREEMPTED,
            )
        return None

    def _oom_policy(self) -> RunSpec:
        """The spec of the next launch after an OOM: half the micro-batch, twice the accumulation."""
        smaller = oom.smaller_micro_batch(self.job.spec.optim.batch_size, self.job.spec.optim.grad_accum)
        assert smaller is not None  # oom_retry said it can shrink
        b, a = smaller
        self.overrides = [f"optim.batch_size={b}", f"optim.grad_accum={a}"]
        self.hooks.info(f"{self.job.stage}: OOM policy: micro-batch {b}, gradient accumulation {a} (same global batch)")
        return self.job.spec.with_overrides(self.overrides)

    def finish(
        self,
        result: proc.ProcResult,
        status: Status,
        error: str | None,
        stop_reason: str | None,
        cause: Cause | None,
        paused_by: str | None = None,
        checkpointed: bool | None = None,
    ) -> Supervision:
        final = {
            "status": str(status),
            "cause": cause,
            "error": error,
            "stop_reason": stop_reason,
            "paused_by": paused_by,
            "checkpointed": checkpointed,
        }
        self.record.write(self.attempts, final)
        return Supervision(status, cause, error, self.attempts, result, stop_reason, self.job, paused_by, checkpointed)


def _sleep(seconds: float, stop_requested: Callable[[], str | None] | None) -> str | None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if stop_requested is not None and (why := stop_requested()):
            return why
        time.sleep(min(0.2, left))
    return None


def _stop_error(cause: Cause | None, detail: str, result: proc.ProcResult) -> str:
    tail = "\n".join(result.tail[-TAIL_LINES:])
    return f"{cause}: {detail}\n--- last {min(TAIL_LINES, len(result.tail))} log lines ---\n{tail}"
