"""The ask-and-tell loop: keep up to ``max_concurrent`` trials in flight until the budget is spent.

The driver does not know how a trial runs: ``run_trial(trial, params) -> TrialOutcome``
may launch a process tree under a Prefect subflow, or train in-process (the benchmark).
Each in-flight trial gets a heartbeat into the Optuna storage; trials of a driver that
died go stale and are re-queued (see :mod:`traingate.sweep.study`), and this loop picks
them up first, because ``study.ask()`` pops waiting trials before sampling new ones.

>>> import optuna
>>> from traingate.sweepspec import SweepSpec
>>> sw = SweepSpec.model_validate({"space": {"x": {"type": "float", "low": 0, "high": 1}},
...                                "sampler": "random", "n_trials": 3})
>>> study = optuna.create_study(direction="maximize")
>>> fn = lambda t, p: TrialOutcome("completed", values=[p["x"]], steps=1)
>>> len(drive(study, sw, fn).finished)
3
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from traingate.job.vocab import Status
from traingate.sweep import compat_optuna
from traingate.sweep.report import TrialOutcome
from traingate.sweep.space import suggest
from traingate.sweepspec import SweepSpec

log = logging.getLogger("traingate.sweep")

RunTrial = Callable[[optuna.Trial, dict[str, Any]], TrialOutcome]


def outcome(t: FrozenTrial) -> dict[str, Any]:
    """What the trial's runner reported (steps, cost_usd, start_ts/end_ts, pid, error, metrics, ...)."""
    return t.user_attrs.get("outcome", {})


@dataclass
class Tally:
    finished: list[FrozenTrial]  # complete, pruned, or failed for good
    running: int
    waiting: int
    cost_usd: float
    steps: int

    @classmethod
    def of(cls, study: optuna.Study) -> Tally:
        trials = study.get_trials(deepcopy=False)
        requeued = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
        finished = [
            t
            for t in trials
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            or (t.state == TrialState.FAIL and t.number not in requeued)
        ]
        return cls(
            finished=finished,
            running=sum(t.state == TrialState.RUNNING for t in trials),
            waiting=sum(t.state == TrialState.WAITING for t in trials),
            cost_usd=sum(float(outcome(t).get("cost_usd", 0.0)) for t in trials),
            steps=sum(int(outcome(t).get("steps", 0)) for t in trials),
        )

    def can_ask(self, n_trials: int) -> bool:
        return self.waiting > 0 or len(self.finished) + self.running < n_trials


@dataclass
class DriveResult:
    finished: list[FrozenTrial]
    stop_reason: str
    steps: int
    cost_usd: float
    trials_run_here: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class _Inline:
    """The executor interface, running each call at once in the calling thread."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - delivered through the future, like a thread pool does
            f.set_exception(e)
        return f

    def shutdown(self, wait: bool = True) -> None:
        pass


def budget_stop(sweep: SweepSpec, tally: Tally, started_ts: float, now: float | None = None) -> str | None:
    """Why no new trial may start (None if one may)."""
    b = sweep.budget
    now = time.time() if now is None else now
    if b.max_wall_s is not None and now - started_ts >= b.max_wall_s:
        return f"wall-clock budget of {b.max_wall_s:.0f} s spent"
    if b.max_cost_usd is not None and tally.cost_usd >= b.max_cost_usd:
        return f"cost budget of ${b.max_cost_usd:.4f} spent (${tally.cost_usd:.4f})"
    return None


def _fail_orphans(study: optuna.Study, grace_s: float) -> None:
    """Fail and re-queue trials a dead driver asked for but never started.

    Optuna judges staleness by heartbeats, and a trial's heartbeat starts when it runs: a driver killed
    between ``ask()`` and naming the trial (its ``trial_key``, set right after) leaves a RUNNING trial
    that never beats and would hold a place in the budget forever. Older than the grace period, it is
    failed and handed to the storage's stale-trial callback (the same re-queue as a stale trial).
    """
    storage = compat_optuna.storage(study)
    callback = getattr(storage, "get_heartbeat_stale_trial_callback", lambda: None)()
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if (
            "trial_key" in t.user_attrs
            or t.datetime_start is None
            or (now - t.datetime_start).total_seconds() <= grace_s
        ):
            continue
        if storage.set_trial_state_values(compat_optuna.trial_id(t), state=TrialState.FAIL):
            log.warning("trial %d was asked by a driver that died before starting it; re-queued", t.number)
            if callback is not None:
                callback(study, study.get_trials(deepcopy=False)[t.number])


@contextlib.contextmanager
def heartbeat(study: optuna.Study, trial: optuna.Trial, every_s: float):
    """Record the trial's heartbeat in the storage until the block ends (no-op without RDB heartbeats)."""
    storage = compat_optuna.storage(study)  # optuna's heartbeat API lives on the storage
    interval = getattr(storage, "get_heartbeat_interval", lambda: None)()  # RDB storages only
    if not hasattr(storage, "record_heartbeat") or not interval:
        yield
        return
    done = threading.Event()

    def beat() -> None:
        while not done.is_set():
            storage.record_heartbeat(compat_optuna.trial_id(trial))
            done.wait(every_s)

    t = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(timeout=every_s + 5)


def _beat_own(study: optuna.Study, trials: Iterable[optuna.Trial]) -> None:
    """Record a heartbeat for each trial this driver is running (no-op without RDB heartbeats).

    Called right before the stale check: this driver is alive, so its trials are, even where their
    heartbeat thread fell more than the grace period behind (a starved thread on a loaded box, a
    long SQLite write lock). Without it the driver would fail and re-queue a trial it is running.
    """
    storage = compat_optuna.storage(study)
    if not hasattr(storage, "record_heartbeat") or not getattr(storage, "get_heartbeat_interval", lambda: None)():
        return
    for t in trials:
        storage.record_heartbeat(compat_optuna.trial_id(t))


def _tell(study: optuna.Study, trial: optuna.Trial, fut: Future) -> None:
    try:
        outcome: TrialOutcome = fut.result()
    except optuna.exceptions.UpdateFinishedTrialError:
        _taken_over(trial)
        return
    except Exception as e:  # noqa: BLE001 - the trial is recorded as FAIL with the error; the sweep goes on
        log.error("trial %d raised %s: %s", trial.number, type(e).__name__, e)
        outcome = TrialOutcome(Status.FAILED, error=f"{type(e).__name__}: {e}", end_ts=time.time())
    try:
        trial.set_user_attr("outcome", outcome.to_dict())  # one write: every storage commit costs an fsync
        if outcome.state == Status.COMPLETED:
            values = outcome.values or []
            study.tell(trial, values if len(values) > 1 else values[0])
        elif outcome.state == Status.PRUNED:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, state=TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        _taken_over(trial)
        return
    log.info(
        "trial %d %s after %d steps%s",
        trial.number,
        outcome.state,
        outcome.steps,
        f": {outcome.error}" if outcome.error else "",
    )


def _taken_over(trial: optuna.Trial) -> None:
    log.warning(
        "trial %d was judged stale and re-queued by another driver while it ran here "
        "(its heartbeat fell more than sweep.grace_s behind); its re-queued copy stands for it",
        trial.number,
    )


@contextlib.contextmanager
def _quiet():
    """Heartbeats are 'experimental' and 'meant for Study.optimize' to Optuna; ask-and-tell is the point here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        yield


def _grid_exhausted(study: optuna.Study) -> bool:
    s = study.sampler
    return isinstance(s, optuna.samplers.GridSampler) and s.is_exhausted(study)


def drive(study: optuna.Study, sweep: SweepSpec, run_trial: RunTrial, poll_s: float = 1.0) -> DriveResult:
    """Run the sweep to its trial budget (or wall-clock / cost budget). Safe to call again after a crash."""
    if "started_ts" not in study.user_attrs:
        study.set_user_attr("started_ts", time.time())
    started = float(study.user_attrs["started_ts"])
    inflight: dict[Future, optuna.Trial] = {}
    ran_here = 0
    stop_reason = ""

    def run(trial: optuna.Trial, params: dict[str, Any]) -> TrialOutcome:
        with heartbeat(study, trial, sweep.heartbeat_s):
            return run_trial(trial, params)

    # One trial at a time runs in the caller's thread (the in-process trainer needs the main thread).
    pool = (
        _Inline() if sweep.max_concurrent == 1 else ThreadPoolExecutor(sweep.max_concurrent, thread_name_prefix="trial")
    )
    try:
        while True:
            with _quiet():
                _beat_own(study, inflight.values())
                _fail_orphans(study, sweep.grace_s)
                optuna.storages.fail_stale_trials(study)
            tally = Tally.of(study)
            stop = budget_stop(sweep, tally, started)
            while (
                len(inflight) < sweep.max_concurrent
                and stop is None
                and tally.can_ask(sweep.n_trials)
                and not (tally.waiting == 0 and _grid_exhausted(study))
            ):
                with _quiet():
                    trial = study.ask()
                if "trial_key" not in trial.user_attrs:  # a re-queued trial keeps its original's key
                    trial.set_user_attr("trial_key", f"trial-{trial.number:04d}")
                params = suggest(trial, sweep.space)
                inflight[pool.submit(run, trial, params)] = trial
                ran_here += 1
                tally = Tally.of(study)
            if not inflight:
                if stop is not None or (tally.running == 0 and tally.waiting == 0):
                    stop_reason = stop or (
                        "search space exhausted" if _grid_exhausted(study) else f"{len(tally.finished)} trials finished"
                    )
                    break
                time.sleep(poll_s)  # trials of another (or a dead) driver: wait for them or their staleness
                continue
            done, _ = wait(inflight, timeout=max(poll_s, sweep.heartbeat_s), return_when=FIRST_COMPLETED)
            for f in done:
                _tell(study, inflight.pop(f), f)
    finally:
        pool.shutdown(wait=True)
    tally = Tally.of(study)
    return DriveResult(
        finished=tally.finished,
        stop_reason=stop_reason,
        steps=tally.steps,
        cost_usd=tally.cost_usd,
        trials_run_here=ran_here,
    )
