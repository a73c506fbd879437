"""What the supervisor does every tick while one launch runs, and how it closes the launch's attempt.

:class:`Watch` follows a built-in recipe's ranks by their heartbeats and last words: how far they got,
whether they hang, whether torchrun restarted the group in place, and what the alert rules say
(:mod:`traingate.supervision.alerting`). :class:`OutputWatch` follows a process whose output is its
only sign of progress (a user's script), by the same hang rule.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from traingate.alerts.rules import Firing
from traingate.job import files
from traingate.job.stagejob import Rollback, StageJob
from traingate.job.vocab import Cause, Status
from traingate.launch import proc
from traingate.monitor.live import StageMonitor
from traingate.recipes.script import OutputProgress
from traingate.supervision import causes, heartbeat
from traingate.supervision.alerting import AlertActions
from traingate.supervision.attempts import Attempt, Hooks, Record
from traingate.supervision.backoff import RetryBudget
from traingate.supervision.checkpoints import is_disk_full, no_block_left

# The step the next launch resumes from, and whether that step is unknown (see RecipeDriver.restart_point).
RestartPoint = Callable[[StageJob], tuple[int | None, bool]]


class Watch:
    """One launch of a built-in recipe, followed by its ranks' heartbeats."""

    def __init__(
        self,
        job: StageJob,
        hang_s: float,
        attempts: list[Attempt],
        budget: RetryBudget,
        hooks: Hooks,
        record: Record,
        restart_point: RestartPoint,
        monitor: StageMonitor | None = None,
        started: float = 0.0,
    ):
        self.job, self.hang_s, self.attempts, self.budget, self.hooks = job, hang_s, attempts, budget, hooks
        self.record, self.restart_point = record, restart_point
        self.alerts = AlertActions(job, hooks, monitor, started, self._stopping)
        self.inplace_cause: Cause | None = None  # why the next in-place restart happens, when we caused it
        self.inplace_detail = ""
        self.stage_dir = Path(job.stage_dir)
        self.hang: str | None = None
        self.stop: str | None = None
        self.disk_full: OSError | None = None  # the stage directory's disk, seen full while the tree ran
        self.restart_count = 0
        self.ckpt_check = 0.0
        self.detector = self._detector(attempts[-1].launched_at)

    @property
    def rollback(self) -> Rollback | None:
        return self.alerts.rollback

    @property
    def alert_stop(self) -> Firing | None:
        return self.alerts.alert_stop

    def _stopping(self, reason: str) -> None:
        self.stop = reason

    def _detector(self, since: float) -> heartbeat.HangDetector:
        sup = self.job.spec.supervision
        return heartbeat.HangDetector(
            self.hang_s, sup.startup_timeout_s, self.job.world_size, since, self.job.max_steps
        )

    def line_hook(self, on_line: Callable[[str], None] | None) -> Callable[[str], None] | None:
        """What reads each line of the launch's output (the caller's ``on_line``)."""
        return on_line

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
        return self._progress(tree, now)

    def _progress(self, tree: proc.ProcessTree, now: float) -> bool:
        stage, sup = self.job.stage, self.job.spec.supervision
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
        full = tree.log_error if is_disk_full(tree.log_error) else no_block_left(self.stage_dir)
        if full is not None:
            # The state directory is full: ranks cannot leave last words there for the check above,
            # and torchrun would restart them in place until the start-up timeout.
            self.disk_full = full
            self.hooks.info(f"{stage}: {full}: stopping the tree (no in-place restart)")
            tree.stop_requested = True
            tree.signal_group(signal.SIGKILL)
            return False
        beats = {r: b for r, b in beats.items() if b.restart_count == self.restart_count}
        self._track(beats)
        if self.alerts.observe(beats, now, self.attempts, tree):
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
            return self.alerts.check_staleness(beats[0], now, tree, self.attempts[-1])
        return False

    def close(self, returncode: int) -> tuple[Attempt, list[files.LastWords]]:
        """The launch exited: close its attempt (the last one) and return it with its last words."""
        words = files.read_last_words(self.stage_dir)
        # Incarnations torchrun started after the last tick (seen only by their last words) end first.
        self.notice_incarnations(
            max([w.restart_count for w in words], default=0), time.time(), files.read_heartbeats(self.stage_dir)
        )
        attempt = self.attempts[-1]  # in-place restarts appended attempts of their own
        attempt.ended_at = time.time()
        attempt.returncode = returncode
        self.observe_end(attempt)
        words = [w for w in words if w.restart_count == self.restart_count]  # the incarnation that just ended
        attempt.last_words = [asdict(w) for w in words]
        return attempt, words

    def restarted(
        self, attempt: Attempt, cause: Cause, number: int, delay: float, overrides: list[str], inplace: bool = False
    ) -> None:
        resume_step, unknown = self.restart_point(self.job)
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
        beats = {
            r: b for r, b in files.read_heartbeats(self.stage_dir).items() if b.restart_count == self.restart_count
        }
        self._track(beats)

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


class OutputWatch(Watch):
    """One launch whose output is its progress (it writes no heartbeat): one "rank" whose heartbeat is its
    output, judged by the same hang detector; the steps are its own (no final step)."""

    def __init__(
        self,
        job: StageJob,
        hang_s: float,
        attempts: list[Attempt],
        budget: RetryBudget,
        hooks: Hooks,
        record: Record,
        restart_point: RestartPoint,
        progress: OutputProgress,
    ):
        self.progress = progress
        super().__init__(job, hang_s, attempts, budget, hooks, record, restart_point)

    def _detector(self, since: float) -> heartbeat.HangDetector:
        sup = self.job.spec.supervision
        what = "metric step" if self.progress.step_progress else "output line"
        return heartbeat.HangDetector(self.hang_s, sup.startup_timeout_s, 1, since, None, progress=what)

    def line_hook(self, on_line: Callable[[str], None] | None) -> Callable[[str], None] | None:
        return self.progress.hook(on_line)

    def _progress(self, tree: proc.ProcessTree, now: float) -> bool:
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

    def observe_end(self, attempt: Attempt) -> None:
        attempt.end_step = self.progress.step


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)  # reaches a SIGSTOPped rank too
    except ProcessLookupError:
        pass  # gone already


def _status(stage_dir: Path) -> Status | None:
    result = files.read_result(stage_dir)
    return result.status if result else None
