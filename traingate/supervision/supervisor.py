"""The restart loop around one training process tree: the one launch path of every StageJob.

Launch the tree, watch its heartbeats, classify how it ended, and either finish, stop
with the cause, or relaunch it from the latest checkpoint after a backoff, within the
retry budget. Ladder stages, resumes, sweep trials and drills all come through here.
Prefect stays outside: the caller hands in plain callables (log a line, emit a restart
event, "should this tree stop now?").

A torchrun group may also restart *in place* after a lost worker (``--max-restarts`` set to
what is left of the budget): no backoff, no new agent, faster than a relaunch. The supervisor
sees it in the heartbeats (their ``restart_count``), records it as an attempt, emits the same
restart event and charges the same budget. Failures an in-place restart cannot fix (a bug, NaN,
an OOM that needs a smaller batch, a full disk) stop the tree at once, so torchrun does not
retry them, and the supervisor decides.

Each launch writes the attempt's StageJob (``job.json``) into the stage directory; the
attempts are kept in ``supervisor.json`` (:mod:`traingate.job.files`).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import random
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from traingate.alerts.rules import Action, Firing, stale_checkpoint
from traingate.capacity import slurm_cli
from traingate.capacity.slurm import SlurmError
from traingate.job import envvars, files
from traingate.job.stagejob import Rollback, StageJob
from traingate.job.vocab import Cause, Status, status_for
from traingate.launch import command, proc
from traingate.monitor import notify
from traingate.monitor.live import StageMonitor, alert_payload
from traingate.recipes import script as script_recipe
from traingate.runtime import warm
from traingate.runtime.checkpoint import Checkpointer, step_dir
from traingate.secrets import resolve
from traingate.spec import apply_overrides, parse_spec
from traingate.storage import storage_failure
from traingate.supervision import causes, heartbeat, oom
from traingate.supervision.backoff import Backoff, RetryBudget
from traingate.tracking.journal import journal_path
from traingate.tracking.tracker import Delivery

log = logging.getLogger(__name__)

TAIL_LINES = 50
TICK_S = 0.2
_interrupt: list[str] = []  # set from a signal handler (Ctrl-C): every running supervision preempts its tree


def request_stop(reason: str) -> None:
    """Ask every supervision in this process to preempt its tree (checkpoint, stop, no restart)."""
    _interrupt.append(reason)


def stop_request() -> str | None:
    return _interrupt[0] if _interrupt else None


@dataclass
class Attempt:
    number: int
    launched_at: float  # epoch seconds
    ended_at: float | None = None  # when the failure was seen (exit, hang, or an in-place restart)
    returncode: int | None = None
    cause: Cause | None = None  # None: completed
    retryable: bool = False
    detail: str = ""
    inplace: bool = False  # torchrun restarted the group in place to start this attempt
    start_steps: dict[int, int] = field(default_factory=dict)  # rank -> step it resumed from
    end_step: int | None = None  # last step rank 0 reported
    first_step_time: float | None = None  # rank 0's first completed step of this attempt
    timeline: dict[str, float] = field(default_factory=dict)  # rank 0's start-up: process start .. checkpoint loaded
    backoff_s: float = 0.0  # waited after this attempt, before the next launch
    overrides: list[str] = field(default_factory=list)  # spec changes of this launch (OOM policy)
    last_words: list[dict[str, Any]] = field(default_factory=list)
    # Written to supervisor.json before the launch (write-ahead): what it runs and the checkpoint it starts
    # from, so a supervisor killed while it runs leaves a record `traingate resume` can close and go on from.
    command: list[str] = field(default_factory=list)
    resume_from_step: int | None = None  # the newest checkpoint on disk at launch (None: none)
    # A script resumed from a checkpoint whose file name holds no step (ckpt.pt): the step is unknown.
    resume_step_unknown: bool = False

    @property
    def start_step(self) -> int | None:
        return self.start_steps.get(0)


@dataclass
class Hooks:
    """What the caller (a Prefect task, the drill, a test) plugs in. All optional."""

    on_line: Callable[[str], None] | None = None
    info: Callable[[str], None] = log.info
    on_restart: Callable[[dict[str, Any]], None] | None = None
    on_alert: Callable[[str, dict[str, Any]], None] | None = None
    # Polled while the tree runs and during backoff; a reason string means "preempt it now, do not restart".
    stop_requested: Callable[[], str | None] | None = None
    # Called every tick while the tree runs (a sweep trial feeds its progress to the pruner here).
    on_tick: Callable[[], None] | None = None


@dataclass
class Supervision:
    status: Status
    cause: Cause | None  # the cause of the last attempt's end (None when completed)
    error: str | None  # cause, detail and (for a stop) the last log lines
    attempts: list[Attempt]
    proc: proc.ProcResult  # the last launch
    stop_reason: str | None = None
    job: StageJob | None = None  # the last attempt's job

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": str(self.status),
            "cause": self.cause,
            "error": self.error,
            "stop_reason": self.stop_reason,
            "restarts": self.restarts,
            "attempts": [asdict(a) for a in self.attempts],
        }


def canary_p99(stage_dir: Path) -> float | None:
    """The canary's p99 step time, when this stage's run has a finished canary beside it."""
    result = files.read_result(stage_dir.parent / "canary")
    profile = (result.metrics.get("profile") if result else None) or {}
    return profile.get("step_time_p99_s") or None


def _latest_checkpoint(uri: str) -> tuple[int | None, float | None]:
    ck = Checkpointer(uri, async_save=False)
    steps = ck.list_steps()
    if not steps:
        return None, None
    return steps[-1], float(ck.manifest(steps[-1]).get("created") or 0.0) or None


def _sleep(seconds: float, stop_requested: Callable[[], str | None] | None) -> str | None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if stop_requested is not None and (why := stop_requested()):
            return why
        time.sleep(min(0.2, left))
    return None


class _Record:
    """supervisor.json: who runs this stage, every attempt, and the verdict."""

    def __init__(self, job: StageJob, earlier: list[dict[str, Any]]):
        self.dir = Path(job.stage_dir)
        self.state = files.SupervisorState(
            job={
                "run_id": job.run_id,
                "stage": job.stage,
                "kind": str(job.kind),
                "mlflow_run_id": job.mlflow_run_id,
                "checkpoint_uri": job.checkpoint_uri,
                "run_dir": job.run_dir,
            },
            supervisor_pid=os.getpid(),
        )
        self.earlier = earlier

    def write(self, attempts: list[Attempt], final: dict[str, Any] | None = None) -> None:
        self.state.attempts = [*self.earlier, *[asdict(a) for a in attempts]]
        self.state.final = final
        try:
            files.write_supervisor_state(self.dir, self.state)
        except OSError as e:
            if not _disk_full(e):
                raise
            # A full state directory is the verdict this supervision reports (disk_full), not a second
            # failure: the attempts stay in the returned Supervision, and the next write tries again.
            log.warning("supervisor.json not updated: %s", e)


def supervise(
    job: StageJob,
    hooks: Hooks | None = None,
    python: str = sys.executable,
    seed: int | None = None,
    resumed: files.SupervisorState | None = None,
) -> Supervision:
    """Run one StageJob to its end under supervision (see the module docstring).

    ``resumed``: the state of an earlier, interrupted supervision of this stage; its attempts
    count, and the first launch here is a restart after its last one.
    """
    # supervision.warm_restarts: one pre-imported zygote forks every worker of this stage's launches
    # (traingate.runtime.warm); it is this process's child, so it dies with the stage.
    zygote = None
    if job.spec.supervision.warm_restarts and not job.is_script and job.nodes == 1:
        Path(job.stage_dir).mkdir(parents=True, exist_ok=True)
        zygote = warm.Zygote(python, envvars.job_environment(job), str(Path(job.stage_dir) / "zygote.log"))
    elif job.spec.supervision.warm_restarts:
        why = (
            "a script recipe (its command is the user's)"
            if job.is_script
            else f"{job.nodes} nodes (a zygote serves the workers of its own host)"
        )
        (hooks or Hooks()).info(f"{job.stage}: supervision.warm_restarts has no effect on {why}; starting it cold")
    delivery = _delivery(job, hooks or Hooks())
    if delivery is not None:
        job = dataclasses.replace(job, tracking_delivery="supervisor")
    try:
        return _supervise(job, hooks, python, seed, resumed, zygote.socket if zygote else None)
    finally:
        if zygote is not None and (off := zygote.stop()) is not None:
            (hooks or Hooks()).info(f"{job.stage}: warm restarts were off (workers started cold): {off}")
        if delivery is not None:
            # Everything the stage logged is in MLflow before its result is read; what an outage kept
            # back stays in the journal for the next process of the stage or `traingate replay`.
            delivery.close()


def _delivery(job: StageJob, hooks: Hooks) -> Delivery | None:
    """The delivery of rank 0's tracking journal, run here: the training processes then only journal."""
    if not (job.spec.tracking.enabled and job.tracking_uri and job.mlflow_run_id and job.writes_heartbeats):
        return None

    path = journal_path(Path(job.stage_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    return Delivery(resolve(job.tracking_uri, field="tracking URI"), job.mlflow_run_id, path)


def _supervise(
    job: StageJob,
    hooks: Hooks | None,
    python: str,
    seed: int | None,
    resumed: files.SupervisorState | None,
    zygote_socket: str | None,
) -> Supervision:
    hooks = hooks or Hooks()
    sup = job.spec.supervision
    stage, stage_dir = job.stage, Path(job.stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    hang_s = sup.hang_timeout_s or heartbeat.hang_timeout(canary_p99(stage_dir), sup.hang_floor_s)
    backoff = Backoff(sup.backoff_base_s, 2.0, sup.backoff_max_s, jitter=0.5)
    budget = RetryBudget(sup.max_restarts, sup.max_downtime_s)
    rng = random.Random(seed)
    deadline = time.monotonic() + job.timeout_s
    earlier = list(resumed.attempts) if resumed else []
    record = _Record(job, earlier)
    attempts: list[Attempt] = []
    overrides: list[str] = []
    stalled = -1  # consecutive failed launches that trained no step (after the first failure: 0)
    if earlier and earlier[-1].get("ended_at") is None:
        earlier[-1] = _orphaned(earlier[-1], len(earlier) - 1, stage_dir, resumed.supervisor_pid if resumed else None)
    if earlier and job.attempt == 0:
        last = earlier[-1]
        job = dataclasses.replace(
            job,
            attempt=len(earlier),
            restart_cause=Cause(last.get("cause") or Cause.PREEMPTED),
            restart_fault_ts=last.get("ended_at"),
        )
    record.write(attempts)
    hooks.info(f"{stage}: supervised: hang timeout {hang_s:.1f} s, up to {sup.max_restarts} restarts")
    started = time.time()
    monitor = (
        StageMonitor(
            job.spec.alerts,
            stage_dir,
            job.slots,
            job.price_per_slot_hour,
            job.budget_usd,
            job.spent_before_usd,
            job.budget_scope,
            started,
        )
        if job.spec.alerts.enabled and job.writes_heartbeats
        else None
    )

    def finish(
        result: proc.ProcResult, status: Status, error: str | None, stop_reason: str | None, cause: Cause | None
    ) -> Supervision:
        record.write(attempts, {"status": str(status), "cause": cause, "error": error, "stop_reason": stop_reason})
        return Supervision(status, cause, error, attempts, result, stop_reason, job)

    while True:
        files.clear_launch_files(stage_dir)
        left = budget.max_restarts - budget.restarts
        # Several nodes: no in-place restarts. Each node's agent counts its own restarts (the ranks'
        # restart_count would disagree across nodes) and a lost node takes its agent with it.
        inplace = job.writes_heartbeats and job.world_size > 1 and job.nodes == 1
        job = job.launch(
            time.time(),
            inplace_restarts=left if inplace else 0,
            script_resume=_script_resumes(job, hooks) if job.is_script else False,
        )
        job.write()
        env = envvars.job_environment(job)
        cmd = command.stage_command(job, python, zygote_socket)
        attempt = Attempt(
            len(attempts),
            job.launched_at or time.time(),
            overrides=list(overrides),
            command=list(cmd),
            resume_from_step=_resume_step(job),
            resume_step_unknown=job.is_script and job.script_resume and _resume_step(job) is None,
        )
        attempts.append(attempt)
        record.write(attempts)  # before the launch: a supervisor killed from here on leaves this attempt open
        hooks.info(f"{stage}: launch {len(attempts)}: {' '.join(cmd)}")
        cwd = job.script.workdir if job.is_script else stage_dir
        # A script writes no heartbeat: its output is its progress (hang detection, the step it reached).
        progress = script_recipe.OutputProgress(job.script.metrics, stage_dir, job.attempt) if job.is_script else None
        on_line = progress.hook(hooks.on_line) if progress is not None else hooks.on_line
        tree = proc.ProcessTree(cmd, env, cwd, stage_dir / files.STDOUT, on_line, TAIL_LINES)
        watch = _Watch(job, hang_s, attempts, budget, hooks, record, monitor, started, progress)
        remaining = max(1.0, deadline - time.monotonic())
        try:
            result = tree.wait(
                timeout_s=remaining,
                grace_s=sup.preempt_grace_s,
                tick=functools.partial(watch.tick, tree),
                tick_every_s=TICK_S,
            )
        except BaseException:
            # The supervisor itself is going away (a runner's SIGTERM on cancel, Ctrl-C): the tree lives
            # in sessions of its own and would outlive us, so preempt it first.
            hooks.info(f"{stage}: supervisor interrupted: SIGTERM to the tree, {sup.preempt_grace_s:.0f} s grace")
            tree.stop(sup.preempt_grace_s)
            raise
        words = files.read_last_words(stage_dir)
        # Incarnations torchrun started after the last tick (seen only by their last words) end first.
        watch.notice_incarnations(
            max([w.restart_count for w in words], default=0), time.time(), files.read_heartbeats(stage_dir)
        )
        attempt = attempts[-1]  # in-place restarts appended attempts of their own
        attempt.ended_at = time.time()
        attempt.returncode = result.returncode
        watch.observe_end(attempt)
        words = [w for w in words if w.restart_count == watch.restart_count]  # the incarnation that just ended
        attempt.last_words = [asdict(w) for w in words]
        if watch.rollback is not None:
            job = _roll_back(job, watch.rollback, attempt, hooks, monitor)
            record.write(attempts)
            continue
        runtime = files.read_result(stage_dir)
        oom_retry = (
            sup.oom_halve_batch
            and oom.smaller_micro_batch(job.spec.optim.batch_size, job.spec.optim.grad_accum) is not None
        )
        verdict = causes.classify(
            causes.Evidence(
                returncode=result.returncode,
                result_status=runtime.status if runtime else None,
                last_words=words,
                log_tail=result.tail,
                hang_detected=watch.hang is not None,
                stop_requested=watch.stop is not None,
                timed_out=result.timed_out,
                world_size=job.world_size if job.writes_heartbeats else None,
                writes_result=job.writes_heartbeats,
            ),
            oom_retry=oom_retry,
        )
        if not verdict.completed and (verdict.cause == Cause.DISK_FULL or _disk_full(result.log_error)):
            verdict = causes.Classification(Cause.DISK_FULL, False, disk_full_detail(job))
        attempt.cause, attempt.retryable = verdict.cause, verdict.retryable
        attempt.detail = watch.hang if verdict.cause == Cause.HANG and watch.hang else verdict.detail
        record.write(attempts)
        unpublished = _publish_script_checkpoints(job, hooks) if job.is_script else None

        if verdict.completed and unpublished is not None:
            err = f"{Cause.TRANSIENT_IO}: the script finished, but {unpublished}"
            return finish(result, Status.FAILED, err, None, Cause.TRANSIENT_IO)
        if verdict.completed:
            return finish(result, Status.COMPLETED, None, None, None)
        if watch.stop is not None and watch.alert_stop is not None and watch.alert_stop.action == Action.STOP:
            err = f"stopped by alert {watch.stop}"
            return finish(result, Status.FAILED, err, watch.stop, Cause.ALERT)
        if watch.stop is not None:
            # Stopped from outside (or paused by an alert): leave the checkpoint for a resume, do not restart.
            written = "written" if verdict.cause == Cause.PREEMPTED else "NOT confirmed"
            how = "paused by alert" if watch.alert_stop is not None else "preempted:"
            err = (
                f"{how} {watch.stop}; emergency checkpoint {written} ({verdict.detail}); "
                f"continue with `traingate resume {job.run_id}`"
            )
            return finish(result, Status.PREEMPTED, err, watch.stop, Cause.PREEMPTED)
        status = status_for(verdict.cause)
        if not verdict.retryable:
            return finish(result, status, _stop_error(verdict.cause, attempt.detail, result), None, verdict.cause)
        # Back off exponentially over failures that made no progress (a crash loop); a launch that
        # trained before it failed (a node lost hours in) restarts after the base delay.
        stalled = 0 if attempt.end_step is not None and attempt.end_step > (attempt.start_step or 0) else stalled + 1
        delay = backoff.delay(stalled, rng)
        cost = attempt.ended_at - attempt.launched_at + delay
        if not budget.allows(cost):
            err = _stop_error(verdict.cause, f"{attempt.detail}; {budget.why_not(cost)}", result)
            return finish(result, status, err, None, verdict.cause)
        if time.monotonic() + delay >= deadline:
            err = _stop_error(verdict.cause, f"{attempt.detail}; no time left in stages.{stage}.timeout_s", result)
            return finish(result, status, err, None, verdict.cause)
        spec = None
        if verdict.cause == Cause.OOM:
            smaller = oom.smaller_micro_batch(job.spec.optim.batch_size, job.spec.optim.grad_accum)
            assert smaller is not None  # oom_retry said it can shrink
            b, a = smaller
            overrides = [f"optim.batch_size={b}", f"optim.grad_accum={a}"]
            spec = parse_spec(apply_overrides(job.spec.to_dict(), overrides))
            hooks.info(f"{stage}: OOM policy: micro-batch {b}, gradient accumulation {a} (same global batch)")
        attempt.backoff_s = delay
        assert verdict.cause is not None, "a retried attempt has a cause"
        watch.restarted(attempt, verdict.cause, len(earlier) + len(attempts), delay, overrides)
        record.write(attempts)
        budget.charge(cost)
        job = job.next_attempt(verdict.cause, attempt.ended_at, spec)
        if (why := _sleep(delay, hooks.stop_requested)) is not None:
            return finish(
                result,
                Status.PREEMPTED,
                f"preempted: {why} while waiting to restart after {verdict.cause}; continue with "
                f"`traingate resume {job.run_id}`",
                why,
                Cause.PREEMPTED,
            )


class _Watch:
    """What the supervisor does every tick while one launch runs."""

    def __init__(
        self,
        job: StageJob,
        hang_s: float,
        attempts: list[Attempt],
        budget: RetryBudget,
        hooks: Hooks,
        record: _Record,
        monitor: StageMonitor | None = None,
        started: float = 0.0,
        progress: script_recipe.OutputProgress | None = None,
    ):
        self.job, self.hang_s, self.attempts, self.budget, self.hooks = job, hang_s, attempts, budget, hooks
        self.progress = progress
        self.record = record
        self.monitor, self.started = monitor, started
        self.rollback: Rollback | None = None  # an alert ordered a roll-back: the tree is being killed
        self.alert_stop: Firing | None = None  # an alert paused or stopped the stage
        self.unsaved_pause: str | None = None  # why a pause writes no emergency checkpoint (nothing good to keep)
        self.inplace_cause: Cause | None = None  # why the next in-place restart happens, when we caused it
        self.inplace_detail = ""
        self.stage_dir = Path(job.stage_dir)
        self.hang: str | None = None
        self.stop: str | None = None
        self.restart_count = 0
        self.ckpt_check = 0.0
        self.alerted = False
        self.detector = self._detector(attempts[-1].launched_at)

    def _detector(self, since: float) -> heartbeat.HangDetector | None:
        sup = self.job.spec.supervision
        if self.progress is not None:
            # A user's script: one "rank" whose heartbeat is its output; its steps are its own (no final step).
            what = "metric step" if self.progress.step_progress else "output line"
            return heartbeat.HangDetector(self.hang_s, sup.startup_timeout_s, 1, since, None, progress=what)
        if not self.job.writes_heartbeats:
            return None
        return heartbeat.HangDetector(
            self.hang_s, sup.startup_timeout_s, self.job.world_size, since, self.job.max_steps
        )

    def tick(self, tree: proc.ProcessTree) -> bool:
        """True: stop the tree (SIGTERM, grace, SIGKILL)."""
        now = time.time()
        stage, sup = self.job.stage, self.job.spec.supervision
        if self.hooks.on_tick is not None:
            self.hooks.on_tick()
        if self.hooks.stop_requested is not None and (why := self.hooks.stop_requested()):
            self.stop = why
            self.hooks.info(
                f"{stage}: {why}: SIGTERM to the tree, {sup.preempt_grace_s:.0f} s grace for the emergency checkpoint"
            )
            return True
        if self.detector is None:
            return False
        if self.progress is not None:
            return self._tick_script(tree, now)
        beats = files.read_heartbeats(self.stage_dir)
        every_word = files.read_last_words(self.stage_dir)
        # An incarnation shows itself by its heartbeats, or by its last words if it failed before its first.
        self.notice_incarnations(
            max([b.restart_count for b in beats.values()] + [w.restart_count for w in every_word], default=0),
            now,
            beats,
        )
        words = [w for w in every_word if w.restart_count == self.restart_count]  # this incarnation's only
        if (fatal := causes.fatal_for_inplace(words, _status(self.stage_dir))) is not None:
            # torchrun would restart the group in place; this failure needs the supervisor's decision.
            self.hooks.info(f"{stage}: {fatal}: stopping the tree (no in-place restart)")
            tree.stop_requested = True
            tree.signal_group(signal.SIGKILL)
            return False
        if _disk_full(tree.log_error):
            # The state directory is full: ranks cannot leave last words there for the check above,
            # and torchrun would restart them in place until the start-up timeout.
            self.hooks.info(f"{stage}: {tree.log_error}: stopping the tree (no in-place restart)")
            tree.stop_requested = True
            tree.signal_group(signal.SIGKILL)
            return False
        beats = {r: b for r, b in beats.items() if b.restart_count == self.restart_count}
        self._track(beats)
        if self.monitor is not None and self.rollback is None:
            self.monitor.observe(beats, now)
            restarts = [a.ended_at for a in self.attempts[:-1] if a.ended_at and a.cause != Cause.ROLLBACK]
            stop = False
            # Rank 0 holding at a spike it saw itself (runtime.spike_guard) waits for this decision: now.
            holding = 0 in beats and beats[0].phase == "holding"
            for firing in self.monitor.poll(now, now - self.started, restarts, force=holding):
                if self.rollback is not None or self.alert_stop is not None:
                    # One action at a time: a spike usually trips the gradient-norm rule at the same step.
                    self._record_alert(
                        firing,
                        "no further action: the stage is already being "
                        f"{'rolled back' if self.rollback is not None else 'stopped'}",
                    )
                    continue
                stop = self._act(firing, tree) or stop
            if stop:
                return True
        # A rank that wrote last words is exiting on a caught error; its peers wait on it in a
        # collective until torchrun tears the group down. That is a failure in progress, not a hang.
        failing = set(beats) if words else set()
        self.detector.observe(beats, now, heartbeat.exited_ranks(beats) | failing)
        if (why := self.detector.stalled(now)) is not None:
            stuck = self.detector.stuck_ranks(now)
            if stuck and self.job.inplace_restarts > self.restart_count and self.budget.allows():
                # torchrun restarts the group in place once the hung rank is gone: quicker than a relaunch.
                self.hooks.info(f"{stage}: hang detected: {why}; killing rank(s) {stuck}, torchrun restarts in place")
                self.inplace_cause, self.inplace_detail = Cause.HANG, why
                for r in stuck:
                    _kill(beats[r].pid)
                self.detector = self._detector(now)  # the group is restarting: start-up rules again
                return False
            # A hung group cannot write an emergency checkpoint: kill it outright.
            self.hang = why
            self.hooks.info(f"{stage}: hang detected: {why}; killing the tree")
            tree.stop_requested = True
            tree.signal_group(signal.SIGKILL)  # reaches a SIGSTOPped rank too
            return False
        if now - self.ckpt_check >= sup.checkpoint_check_s and 0 in beats:
            self.ckpt_check = now
            return self._check_staleness(beats[0], now, tree)
        return False

    def _tick_script(self, tree: proc.ProcessTree, now: float) -> bool:
        """Hang detection of a script from its output, by the same detector (and rule) as recipes' heartbeats."""
        assert self.progress is not None and self.detector is not None
        if (reading := self.progress.reading()) is not None:
            counter, when = reading
            self.detector.observe({0: files.Heartbeat(rank=0, step=counter, time=when, pid=tree.pid)}, now)
        if self.progress.step is not None:
            self.attempts[-1].end_step = self.progress.step
        if (why := self.detector.stalled(now)) is not None:
            self.hang = why
            self.hooks.info(f"{self.job.stage}: hang detected: {why}; killing the script's tree")
            tree.stop_requested = True
            tree.signal_group(signal.SIGKILL)  # a hung script cannot be trusted to act on SIGTERM
        return False

    def _act(self, f: Firing, tree: proc.ProcessTree) -> bool:
        """Carry out an alert's action; True: stop the tree with SIGTERM (its emergency checkpoint)."""
        stage = self.job.stage
        action = f.action
        rb = self.job.spec.alerts.rollback
        if action == Action.ROLLBACK and len(self.job.rollbacks) >= rb.max_rollbacks:
            action = Action.PAUSE
            outcome = f"paused: alerts.rollback.max_rollbacks ({rb.max_rollbacks}) roll-backs already done"
        elif action == Action.ROLLBACK:
            steps = Checkpointer(self.job.checkpoint_uri, async_save=False).list_steps()
            at = int(f.at)
            to = max((s for s in steps if s < at), default=None)
            if to is None:
                # Going back to step 0 would throw the run away; a checkpoint written now would hold the state
                # gone bad. Stop without one and say so: the person deciding has the numbers.
                action = Action.PAUSE
                self.unsaved_pause = f"no checkpoint before step {at} to roll back to"
                outcome = (
                    f"paused: {self.unsaved_pause} (none written: it would hold the state gone bad); "
                    f"`traingate resume {self.job.run_id}` starts the stage over"
                )
            else:
                self.rollback = Rollback(
                    to_step=to,
                    at_step=at,
                    skip=at - to if rb.skip_batches else 0,
                    lr_scale=rb.lr_scale,
                    rule=str(f.rule),
                )
                outcome = (
                    f"rolling back to step {to} (checkpoint), skipping {self.rollback.skip} batches, "
                    f"learning rate x{rb.lr_scale:g}"
                )
        elif (
            action == Action.QUARANTINE
            and (node := slurm_cli.node_of_rank(_whole(f.values.get("rank")), self.job.procs_per_node, os.environ))
            is not None
        ):
            # On a Slurm pool the engine keeps the host out of every later job: drain it.
            _quarantine(self.job, node, f)
            try:
                slurm_cli.set_node_state(node, "drain", f"traingate:{f.rule}")
                drained = f"Slurm node {node} drained (reason traingate:{f.rule})"
            except SlurmError as e:
                drained = f"Slurm node {node} NOT drained ({e})"
            action = Action.PAUSE
            outcome = (
                f"{drained}, quarantine.json; paused: resume with `traingate resume {self.job.run_id}`, "
                "Slurm places it on other nodes"
            )
        elif action == Action.QUARANTINE:
            # One host per stage here: leaving it out of the next launch leaves nothing to launch on.
            host = socket.gethostname()
            _quarantine(self.job, host, f)
            action = Action.PAUSE
            outcome = (
                f"host {host} quarantined (run directory quarantine.json); paused: no other host for this "
                f"stage; resume on a healthy host with `traingate resume {self.job.run_id}`"
            )
        else:
            outcome = {
                Action.NOTIFY: "notified",
                Action.PAUSE: f"paused at an emergency checkpoint; continue with `traingate resume {self.job.run_id}`",
                Action.STOP: "stopped for good",
            }[action]
        self._record_alert(f, outcome)
        if action == Action.ROLLBACK:
            tree.stop_requested = True
            tree.signal_group(signal.SIGKILL)  # no emergency checkpoint: it would save the state gone bad
            return False
        if action in (Action.PAUSE, Action.STOP):
            self.alert_stop = dataclasses.replace(f, action=action)
            self.stop = f"{f.rule}: {f.message}"
            if self.unsaved_pause is not None:
                self.stop += f"; {self.unsaved_pause}"
                self.hooks.info(f"{stage}: paused by alert {f.rule}: SIGKILL to the tree, no emergency checkpoint")
                tree.stop_requested = True
                tree.signal_group(signal.SIGKILL)
                return False
            self.hooks.info(
                f"{stage}: {action} by alert {f.rule}: SIGTERM to the tree, "
                f"{self.job.spec.supervision.preempt_grace_s:.0f} s grace for the emergency checkpoint"
            )
            return True
        return False

    def _record_alert(self, f: Firing, outcome: str) -> None:
        """Every firing: a line in alerts.jsonl and in the run's logbook, the log, and the caller's hook
        (a Prefect event and an MLflow tag in the launch task)."""
        now = time.time()
        payload = {**alert_payload(f, self.job.stage, self.job.attempt), "outcome": outcome}
        files.append_alert(
            self.stage_dir,
            files.AlertRecord(
                time=now,
                stage=self.job.stage,
                rule=str(f.rule),
                severity=str(f.severity),
                action=str(f.action),
                at=f.at,
                message=f.message,
                attempt=self.job.attempt,
                outcome=outcome,
                values=payload["values"],
            ),
        )
        files.append_logbook(
            Path(self.job.run_dir),
            files.LogbookEntry(
                time=now, stage=self.job.stage, kind="alert", text=f"{f.message} -> {outcome}", data=payload
            ),
        )
        self.hooks.info(f"{self.job.stage}: ALERT {f.severity} {f.message} -> {outcome}")
        if self.hooks.on_alert is not None:
            self.hooks.on_alert(f"alert.{f.rule}", payload)
        if self.job.spec.alerts.webhook_url:
            notify.post(self.job.spec.alerts.webhook_url, {"run_id": self.job.run_id, **payload}, self.hooks.info)

    def _track(self, beats: dict[int, files.Heartbeat]) -> None:
        a = self.attempts[-1]
        if 0 in beats:
            a.end_step = beats[0].step
            a.first_step_time = beats[0].first_step_time
            a.timeline = dict(beats[0].timeline)
        for r, b in beats.items():
            a.start_steps.setdefault(r, b.start_step)

    def notice_incarnations(self, newest: int, now: float, beats: dict[int, files.Heartbeat] | None = None) -> None:
        """Close the attempts of incarnations torchrun has replaced, each with the cause it ended with.

        Times are the incarnations' own (its first last words; the next one's process start), not when
        the supervisor noticed: a fault is charged to the incarnation it hit.
        """
        while self.restart_count < newest:
            old = self.attempts[-1]
            words = files.read_last_words(self.stage_dir, self.restart_count)  # why that incarnation ended
            nxt = self.restart_count + 1
            started = min(
                (
                    b.timeline["process_start"]
                    for b in (beats or {}).values()
                    if b.restart_count == nxt and "process_start" in b.timeline
                ),
                default=None,
            )
            failed = min((w.time for w in words), default=None)
            old.ended_at = min(t for t in (failed, started, now) if t is not None)
            old.retryable = True
            if self.inplace_cause is not None:  # we killed a hung rank ourselves
                old.cause, old.detail = self.inplace_cause, self.inplace_detail
                self.inplace_cause = None
            else:
                old.cause, old.detail = causes.restarted_in_place(words, self.job.world_size)
            old.last_words = [asdict(w) for w in words]
            self.restart_count = nxt
            self.restarted(old, old.cause, len(self.attempts), 0.0, [], inplace=True)
            self.budget.charge(old.ended_at - old.launched_at)
            self.attempts.append(Attempt(len(self.attempts), max(old.ended_at, started or old.ended_at), inplace=True))
            self.detector = self._detector(now)
            self.record.write(self.attempts)

    def restarted(
        self, attempt: Attempt, cause: Cause, number: int, delay: float, overrides: list[str], inplace: bool = False
    ) -> None:
        if self.job.is_script:
            s = self.job.script
            resume_step = script_recipe.latest_step(self.job.checkpoint_dir, s.checkpoints) if s.resume_args else None
            # It resumes from a checkpoint whose name holds no step: from where is unknown, and so are the steps lost.
            unknown = (
                bool(s.resume_args)
                and resume_step is None
                and script_recipe.has_checkpoint(self.job.checkpoint_dir, s.checkpoints)
            )
        else:
            resume_step, _ = _latest_checkpoint(self.job.checkpoint_uri) if self.job.writes_heartbeats else (None, None)
            unknown = False
        event = {
            "stage": self.job.stage,
            "run_id": self.job.run_id,
            "cause": str(cause),
            "detail": attempt.detail,
            "restart": number,
            "backoff_s": round(delay, 3),
            "failed_at_step": attempt.end_step,
            "resume_from_step": "unknown" if unknown else resume_step or 0,
            "inplace": inplace,
            "steps_lost": None if unknown else max(0, (attempt.end_step or 0) - (resume_step or 0)),
            "overrides": overrides,
        }
        how = "torchrun restarted the group in place" if inplace else f"restart in {delay:.1f} s"
        self.hooks.info(
            f"{self.job.stage}: {cause} ({attempt.detail}); restart {number}/"
            f"{self.job.spec.supervision.max_restarts} from "
            f"{'an unknown step (its checkpoint file name holds none)' if unknown else f'step {resume_step or 0}'}"
            f": {how}"
        )
        if self.hooks.on_restart is not None:
            self.hooks.on_restart(event)

    def observe_end(self, attempt: Attempt) -> None:
        if self.progress is not None:
            attempt.end_step = self.progress.step
            return
        beats = {
            r: b for r, b in files.read_heartbeats(self.stage_dir).items() if b.restart_count == self.restart_count
        }
        self._track(beats)

    def _check_staleness(self, beat: files.Heartbeat, now: float, tree: proc.ProcessTree) -> bool:
        """alerts.checkpoint_stale: no new checkpoint within its `factor` x the checkpoint interval (steps or
        minutes), counted from the newest checkpoint or this launch. Fires once per stale spell and carries
        out its action like every alert; True: stop the tree (pause, stop)."""
        alerts = self.job.spec.alerts
        if not (alerts.enabled and alerts.checkpoint_stale.enabled):
            return False
        attempt = self.attempts[-1]
        last_step, created = _latest_checkpoint(self.job.checkpoint_uri)
        start = attempt.start_steps.get(0, beat.start_step)
        # From rank 0's first step at the earliest: start-up (imports, rendezvous, loading) writes no checkpoint.
        since = now - max(created or 0.0, attempt.launched_at, beat.first_step_time or now)
        why = heartbeat.checkpoint_stale(
            beat.step,
            max(last_step or 0, start or 0),
            self.job.checkpoint_every_steps,
            since,
            self.job.checkpoint_every_s,
            factor=alerts.checkpoint_stale.factor,
        )
        if why is None:
            self.alerted = False
            return False
        if self.alerted or self.rollback is not None or self.alert_stop is not None:
            return False
        self.alerted = True
        return self._act(stale_checkpoint(why, beat.step, alerts.checkpoint_stale), tree)


def _whole(value: float | None) -> int | None:
    """A firing's rank value (signals are floats) as the rank it is."""
    return None if value is None else int(value)


def _script_resumes(job: StageJob, hooks: Hooks) -> bool:
    """Whether this launch of a script appends its resume_args, decided from what is on disk and never
    from the attempt records (a supervisor killed mid-launch leaves its attempt unfinished): the script's
    declared checkpoint is there. Its checkpoint dir is made first; on a host without the local copy the
    set published at a remote checkpoint URI is brought back first."""
    s = job.script
    Path(job.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    if not s.resume_args:
        if script_recipe.has_checkpoint(job.checkpoint_dir, s.checkpoints):
            hooks.info(
                f"{job.stage}: the script's checkpoints are in {job.checkpoint_dir} but recipe.script.resume_args "
                "is empty: it starts over and may overwrite them; declare the flags that make it resume"
            )
        return False
    if restored := script_recipe.restore(job.checkpoint_uri, job.checkpoint_dir, s.checkpoints):
        hooks.info(f"{job.stage}: {len(restored)} checkpoint file(s) brought back from {job.checkpoint_uri}")
    if script_recipe.has_checkpoint(job.checkpoint_dir, s.checkpoints):
        return True
    if job.attempt > 0:
        hooks.info(
            f"{job.stage}: restart {job.attempt}: the script left no checkpoint yet "
            f"({s.checkpoints or 'an empty checkpoint dir'}); it starts over, without its resume_args"
        )
    return False


def _resume_step(job: StageJob) -> int | None:
    """The checkpoint step this launch starts from: the newest on disk (a script's: by its file name, and
    only when its resume_args are appended). Recorded with the attempt before it launches."""
    if job.is_script:
        s = job.script
        return script_recipe.latest_step(job.checkpoint_dir, s.checkpoints) if job.script_resume else None
    return _latest_checkpoint(job.checkpoint_uri)[0]


def _orphaned(record: dict[str, Any], number: int, stage_dir: Path, supervisor_pid: int | None) -> dict[str, Any]:
    """An attempt the record shows as running whose supervisor is gone (killed with the CLI): closed as
    ``orchestrator_lost`` at the last sign of life of its processes, with the step rank 0 last reported
    (a script's: the last its output showed, from the metric points of attempt ``number``)."""
    beats = files.read_heartbeats(stage_dir)
    words = files.read_last_words(stage_dir)
    out = stage_dir / files.STDOUT
    seen = [b.time for b in beats.values()] + [w.time for w in words]
    if out.exists():
        seen.append(out.stat().st_mtime)
    launched = float(record.get("launched_at") or 0.0)
    shown = [p.step for p in files.read_script_points(stage_dir) if p.attempt == number]
    primary = causes.primary_words(words)
    detail = f"its supervisor (pid {supervisor_pid or '?'}) died while it ran"
    if primary:
        detail += f"; rank {primary[0].rank}: {primary[0].error}"
    return {
        **record,
        "ended_at": max([launched, *seen]),
        "cause": str(Cause.ORCHESTRATOR_LOST),
        "retryable": True,
        "detail": detail,
        "end_step": beats[0].step if 0 in beats else max(shown, default=record.get("end_step")),
        "last_words": [asdict(w) for w in words],
    }


def _publish_script_checkpoints(job: StageJob, hooks: Hooks) -> str | None:
    """Index (and upload, to a remote URI) what the script declared it writes; after every launch, so a
    restart on another host finds them. Returns why it failed, for a storage error, else None."""

    s = job.script
    if s.checkpoints is None:
        return None
    try:
        entries = script_recipe.publish(job.checkpoint_dir, s.checkpoints, job.checkpoint_uri)
    except Exception as e:  # noqa: BLE001 - storage errors are reported; anything else is a bug and raised
        why = storage_failure(e)
        if why is None:
            raise
        msg = f"its checkpoints were not published to {job.checkpoint_uri}: {why}"
        hooks.info(f"{job.stage}: {msg}")
        return msg
    last = script_recipe.newest(entries)
    hooks.info(
        f"{job.stage}: {len(entries)} checkpoint file(s) indexed at {job.checkpoint_uri}"
        + (f", newest {last.path}" if last is not None else "")
    )
    return None


def _roll_back(job: StageJob, rb: Rollback, attempt: Attempt, hooks: Hooks, monitor: StageMonitor | None) -> StageJob:
    """After the tree was killed for a roll-back: set the checkpoints after the target aside (no restart may
    resume from the state gone bad; they are removed only once the rolled-back run passes their steps), log
    it, and return the next attempt's job carrying the mitigation."""
    attempt.cause, attempt.retryable = Cause.ROLLBACK, True
    attempt.detail = f"{rb.rule} at step {rb.at_step}: back to step {rb.to_step}"
    aside = Checkpointer(job.checkpoint_uri, async_save=False).set_aside_after(rb.to_step)
    text = (
        f"rolled back from step {attempt.end_step} to step {rb.to_step} after {rb.rule} at step {rb.at_step}: "
        f"skipping {rb.skip} batches, learning rate x{rb.lr_scale:g}, checkpoints set aside: {aside or 'none'}"
    )
    hooks.info(f"{job.stage}: {text}")
    files.append_logbook(
        Path(job.run_dir),
        files.LogbookEntry(
            time=time.time(),
            stage=job.stage,
            kind="rollback",
            text=text,
            data={**asdict(rb), "from_step": attempt.end_step, "set_aside_checkpoints": aside},
        ),
    )
    if hooks.on_alert is not None:
        hooks.on_alert("run.rolled_back", {"stage": job.stage, **asdict(rb), "from_step": attempt.end_step})
    nxt = job.next_attempt(Cause.ROLLBACK, attempt.ended_at)
    nxt = dataclasses.replace(nxt, rollbacks=(*job.rollbacks, rb))
    if monitor is not None:
        monitor.rewind(rb.to_step, nxt.attempt)
    return nxt


def _quarantine(job: StageJob, host: str, f: Firing) -> None:
    path = Path(job.run_dir) / "quarantine.json"
    entries = files.read_json(path) or []
    entries.append(
        {
            "host": host,
            "stage": job.stage,
            "rule": str(f.rule),
            "message": f.message,
            "time": time.time(),
            "rank": f.values.get("rank"),
        }
    )
    files.write_json(path, entries)


def _disk_full(e: OSError | None) -> bool:
    return e is not None and e.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full_detail(job: StageJob) -> str:
    """Which of the stage's local locations is full, and about how much it needs (one line)."""
    ckpt_dir = job.checkpoint_uri.removeprefix("file://") if job.checkpoint_uri.startswith("file://") else None
    places = [("the state directory (TRAINGATE_STATE_DIR)", Path(job.stage_dir))]
    if ckpt_dir:
        places.append(("the checkpoint store (checkpoint.uri / TRAINGATE_CHECKPOINT_URI)", Path(ckpt_dir)))
    # A checkpoint is written beside the previous one before retention removes it: about one more of its size.
    step = Checkpointer(job.checkpoint_uri, async_save=False).find_latest(verify=False) if ckpt_dir else None
    need = _tree_bytes(Path(ckpt_dir) / step_dir(step)) if step is not None and ckpt_dir else 0
    name, where, free = min(((n, p, _free(p)) for n, p in places), key=lambda x: x[2])
    # Sized by the newest checkpoint (the next one is written beside it); before the first checkpoint
    # there is nothing to size it by, and only a lower bound is honest.
    needs = f"needs about {need / 2**20:.1f} MiB more (one checkpoint)" if need else "needs at least 1.0 MiB more"
    return (
        f"no space left on device in {name} at {where}: {free / 2**20:.1f} MiB free, {needs}; "
        f"free space there or point it at a larger disk, then continue with `traingate resume {job.run_id}`"
    )


def _free(path: Path) -> int:
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return 0


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)  # reaches a SIGSTOPped rank too
    except ProcessLookupError:
        pass  # gone already


def _status(stage_dir: Path) -> Status | None:
    result = files.read_result(stage_dir)
    return result.status if result else None


def _stop_error(cause: Cause | None, detail: str, result: proc.ProcResult) -> str:
    if cause == Cause.DISK_FULL:
        return f"{cause}: {detail}"  # the location and the space it needs say it all; a log tail only buries it
    tail = "\n".join(result.tail[-TAIL_LINES:])
    return f"{cause}: {detail}\n--- last {min(TAIL_LINES, len(result.tail))} log lines ---\n{tail}"


def read_state(stage_dir: Path) -> files.SupervisorState | None:
    """What a supervisor wrote about a stage (for `traingate resume` and drills)."""
    return files.read_supervisor_state(stage_dir)
