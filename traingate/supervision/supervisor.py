"""The restart loop around one training process tree.

Launch the tree, watch its heartbeats, classify how it ended, and either finish,
stop with the cause, or relaunch it from the latest checkpoint after a backoff,
within the retry budget. Prefect stays outside: the task hands in plain callables
(log a line, emit a restart event, "has the flow run been cancelled?").

Each relaunch gets ``TRAINGATE_RESTART_CAUSE``, ``TRAINGATE_RESTART_COUNT`` and
``TRAINGATE_RESTART_FAULT_TS`` (epoch seconds the fault was seen) in its environment,
so the tracker inside can record the restart against the run. Every attempt is
written to ``<stage_dir>/supervisor.json``.
"""
from __future__ import annotations

import json
import logging
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from traingate import launch, proc
from traingate.runtime import env as renv
from traingate.runtime.checkpoint import Checkpointer
from traingate.spec import RunSpec, apply_overrides, parse_spec, write_resolved
from traingate.supervision import causes, heartbeat, oom
from traingate.supervision.backoff import Backoff, RetryBudget

log = logging.getLogger(__name__)

RESTART_CAUSE = "TRAINGATE_RESTART_CAUSE"
RESTART_COUNT = "TRAINGATE_RESTART_COUNT"
RESTART_FAULT_TS = "TRAINGATE_RESTART_FAULT_TS"
STATE_FILE = "supervisor.json"
TAIL_LINES = 50
# Per-launch files: a new launch must not be judged by the previous one's heartbeats or last words.
_LAUNCH_FILES = ("heartbeat.rank*.json", "last_words.rank*.json", "result.json")


@dataclass
class Attempt:
    number: int
    launched_at: float                       # epoch seconds
    ended_at: float | None = None            # when the failure was seen (exit, or hang detected)
    returncode: int | None = None
    cause: str | None = None                 # None: completed
    retryable: bool = False
    detail: str = ""
    start_steps: dict[int, int] = field(default_factory=dict)   # rank -> step it resumed from
    end_step: int | None = None              # last step rank 0 reported
    first_step_time: float | None = None     # rank 0's first completed step of this launch
    backoff_s: float = 0.0                   # waited after this attempt, before the next launch
    overrides: list[str] = field(default_factory=list)  # spec changes of this launch (OOM policy)
    last_words: list[dict[str, Any]] = field(default_factory=list)

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


@dataclass
class Supervision:
    status: str                  # completed | preempted | diverged | failed
    cause: str | None            # the cause of the last launch's end (None when completed)
    error: str | None            # cause, detail and (for a stop) the last log lines
    attempts: list[Attempt]
    proc: proc.ProcResult        # the last launch
    stop_reason: str | None = None

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "cause": self.cause, "error": self.error, "stop_reason": self.stop_reason,
                "restarts": self.restarts, "attempts": [asdict(a) for a in self.attempts]}


def canary_p99(stage_dir: Path) -> float | None:
    """The canary's p99 step time, when this stage's run has a finished canary beside it."""
    path = stage_dir.parent / "canary" / "result.json"
    try:
        profile = json.loads(path.read_text())["metrics"].get("profile") or {}
    except (OSError, ValueError, KeyError):
        return None
    return profile.get("step_time_p99_s") or None


def _latest_checkpoint(uri: str) -> tuple[int | None, float | None]:
    ck = Checkpointer(uri, async_save=False)
    steps = ck.list_steps()
    if not steps:
        return None, None
    return steps[-1], float(ck.manifest(steps[-1]).get("created") or 0.0) or None


def _clear_launch_files(stage_dir: Path) -> None:
    for pattern in _LAUNCH_FILES:
        for p in stage_dir.glob(pattern):
            p.unlink(missing_ok=True)


def _sleep(seconds: float, stop_requested: Callable[[], str | None] | None) -> str | None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if stop_requested is not None and (why := stop_requested()):
            return why
        time.sleep(min(0.2, left))
    return None


def supervise(spec: RunSpec, stage: str, spec_path: Path, stage_dir: Path, env: dict[str, str],
              python: str = sys.executable, hooks: Hooks | None = None, seed: int | None = None,
              resumed: dict[str, Any] | None = None) -> Supervision:
    """Run one training stage to its end under supervision (see the module docstring).

    ``resumed``: the state file of an earlier, interrupted supervision of this stage
    (:func:`read_state`); its first launch then counts as a restart after that one.
    """
    hooks = hooks or Hooks()
    sup = spec.supervision
    limits = getattr(spec.stages, stage)
    nodes, nproc = launch.stage_world(spec, stage)
    world = nodes * nproc
    hang_s = sup.hang_timeout_s or heartbeat.hang_timeout(canary_p99(stage_dir), sup.hang_floor_s)
    backoff = Backoff(sup.backoff_base_s, 2.0, sup.backoff_max_s, jitter=0.5)
    budget = RetryBudget(sup.max_restarts, sup.max_downtime_s)
    rng = random.Random(seed)
    ckpt_uri = env[renv.CHECKPOINT_URI]
    deadline = time.monotonic() + limits.timeout_s
    attempts: list[Attempt] = []
    current_spec, current_path = spec, spec_path
    overrides: list[str] = []
    stage_dir.mkdir(parents=True, exist_ok=True)
    # Enough to relaunch this stage later (`traingate resume`), whoever started it.
    launch_meta = {"run_id": env.get(renv.RUN_ID), "stage": stage, "spec_path": str(spec_path),
                   "mlflow_run_id": env.get("MLFLOW_RUN_ID"), "checkpoint_uri": ckpt_uri}
    (stage_dir / STATE_FILE).write_text(json.dumps({"launch": launch_meta, "attempts": [], "final": None}))
    hooks.info(f"{stage}: supervised: hang timeout {hang_s:.1f} s, up to {sup.max_restarts} restarts")

    while True:
        n = len(attempts)
        _clear_launch_files(stage_dir)
        run_env = dict(env)
        run_env[renv.LAUNCH_TS] = repr(time.time())
        earlier = (resumed or {}).get("attempts") or []
        if attempts or earlier:
            prev = asdict(attempts[-1]) if attempts else earlier[-1]
            run_env.update({RESTART_CAUSE: str(prev["cause"]), RESTART_COUNT: str(len(earlier) + n),
                            RESTART_FAULT_TS: repr(prev["ended_at"])})
        cmd = launch.stage_command(current_spec, stage, current_path, python)
        attempt = Attempt(n, time.time(), overrides=list(overrides))
        attempts.append(attempt)
        hooks.info(f"{stage}: launch {n + 1}: {' '.join(cmd)}")
        tree = proc.ProcessTree(cmd, run_env, stage_dir, stage_dir / "stdout.log", hooks.on_line, TAIL_LINES)
        watch = heartbeat.HangDetector(hang_s, sup.startup_timeout_s, world, attempt.launched_at, limits.max_steps)
        state: dict[str, Any] = {"hang": None, "stop": None, "ckpt_check": 0.0, "alerted": False}

        def tick() -> bool:
            now = time.time()
            if hooks.stop_requested is not None and (why := hooks.stop_requested()):
                state["stop"] = why
                hooks.info(f"{stage}: {why}: SIGTERM to the tree, {sup.preempt_grace_s:.0f} s grace for the "
                           "emergency checkpoint")
                return True  # ProcessTree.stop: SIGTERM, grace, SIGKILL
            beats = heartbeat.read_heartbeats(stage_dir)
            # A rank that wrote last words is exiting on a caught error; its peers wait on it in a
            # collective until torchrun tears the group down. That is a failure in progress, not a hang.
            failing = set(beats) if any(stage_dir.glob("last_words.rank*.json")) else set()
            watch.observe(beats, now, heartbeat.exited_ranks(beats) | failing)
            if (why := watch.stalled(now)) is not None:
                # A hung group cannot write an emergency checkpoint: kill it outright.
                state["hang"] = why
                hooks.info(f"{stage}: hang detected: {why}; killing the tree")
                tree.stop_requested = True
                tree.signal_group(signal.SIGKILL)  # reaches a SIGSTOPped rank too
                return False
            if now - state["ckpt_check"] >= sup.checkpoint_check_s and 0 in beats:
                state["ckpt_check"] = now
                _check_staleness(spec, stage, ckpt_uri, beats[0], attempt, state, hooks, now)
            return False

        remaining = max(1.0, deadline - time.monotonic())
        try:
            result = tree.wait(timeout_s=remaining, grace_s=sup.preempt_grace_s, tick=tick)
        except BaseException:
            # The supervisor itself is going away (a runner's SIGTERM on cancel, Ctrl-C): the tree lives
            # in sessions of its own and would outlive us, so preempt it first.
            hooks.info(f"{stage}: supervisor interrupted: SIGTERM to the tree, {sup.preempt_grace_s:.0f} s grace")
            tree.stop(sup.preempt_grace_s)
            raise
        attempt.ended_at = time.time()
        attempt.returncode = result.returncode
        beats = heartbeat.read_heartbeats(stage_dir)
        attempt.start_steps = {r: int(b.get("start_step", 0)) for r, b in sorted(beats.items())}
        if 0 in beats:
            attempt.end_step = int(beats[0].get("step", 0))
            attempt.first_step_time = beats[0].get("first_step_time")
        attempt.last_words = heartbeat.read_last_words(stage_dir)
        result_status = _result_status(stage_dir)
        oom_retry = sup.oom_halve_batch and oom.smaller_micro_batch(
            current_spec.optim.batch_size, current_spec.optim.grad_accum) is not None
        verdict = causes.classify(causes.Evidence(
            returncode=result.returncode, result_status=result_status, last_words=attempt.last_words,
            log_tail=result.tail, hang_detected=state["hang"] is not None,
            stop_requested=state["stop"] is not None, timed_out=result.timed_out), oom_retry=oom_retry)
        attempt.cause, attempt.retryable = verdict.cause, verdict.retryable
        attempt.detail = state["hang"] if verdict.cause == causes.HANG else verdict.detail
        _write_state(stage_dir, attempts, None)

        if verdict.completed:
            return _finish(stage_dir, attempts, result, "completed", None, None)
        if state["stop"] is not None:
            # Cancelled from outside: leave the checkpoint for `traingate resume`, do not restart.
            written = "written" if verdict.cause == causes.PREEMPTED else "NOT confirmed"
            err = (f"preempted: {state['stop']}; emergency checkpoint {written} ({verdict.detail}); "
                   f"continue with `traingate resume {env.get(renv.RUN_ID, 'RUN_ID')}`")
            return _finish(stage_dir, attempts, result, "preempted", err, state["stop"], cause=causes.PREEMPTED)
        status = "diverged" if verdict.cause == causes.DIVERGED else "failed"
        if not verdict.retryable:
            return _finish(stage_dir, attempts, result, status, _stop_error(verdict.cause, attempt.detail, result),
                           None, cause=verdict.cause)
        delay = backoff.delay(budget.restarts, rng)
        cost = attempt.ended_at - attempt.launched_at + delay
        if not budget.allows(cost):
            err = _stop_error(verdict.cause, f"{attempt.detail}; {budget.why_not(cost)}", result)
            return _finish(stage_dir, attempts, result, status, err, None, cause=verdict.cause)
        if time.monotonic() + delay >= deadline:
            err = _stop_error(verdict.cause, f"{attempt.detail}; no time left in stages.{stage}.timeout_s", result)
            return _finish(stage_dir, attempts, result, status, err, None, cause=verdict.cause)
        if verdict.cause == causes.OOM:
            smaller = oom.smaller_micro_batch(current_spec.optim.batch_size, current_spec.optim.grad_accum)
            assert smaller is not None  # oom_retry said it can shrink
            b, a = smaller
            overrides = [f"optim.batch_size={b}", f"optim.grad_accum={a}"]
            current_spec = parse_spec(apply_overrides(spec.to_dict(), overrides))
            current_path = write_resolved(current_spec, stage_dir / f"spec.restart{n + 1}.yaml")
            hooks.info(f"{stage}: OOM policy: micro-batch {b}, gradient accumulation {a} (same global batch)")
        resume_step, _ = _latest_checkpoint(ckpt_uri)
        attempt.backoff_s = delay
        event = {"stage": stage, "run_id": env.get(renv.RUN_ID), "cause": verdict.cause, "detail": attempt.detail,
                 "restart": n + 1, "backoff_s": round(delay, 3), "failed_at_step": attempt.end_step,
                 "resume_from_step": resume_step or 0,
                 "steps_lost": max(0, (attempt.end_step or 0) - (resume_step or 0)), "overrides": overrides}
        hooks.info(f"{stage}: {verdict.cause} ({attempt.detail}); restart {n + 1}/{sup.max_restarts} from step "
                   f"{resume_step or 0} in {delay:.1f} s")
        if hooks.on_restart is not None:
            hooks.on_restart(event)
        _write_state(stage_dir, attempts, None)
        budget.charge(cost)
        if (why := _sleep(delay, hooks.stop_requested)) is not None:
            return _finish(stage_dir, attempts, result, "preempted",
                           f"preempted: {why} while waiting to restart after {verdict.cause}; continue with "
                           f"`traingate resume {env.get(renv.RUN_ID, 'RUN_ID')}`", why, cause=causes.PREEMPTED)


def _check_staleness(spec: RunSpec, stage: str, ckpt_uri: str, beat: dict[str, Any], attempt: Attempt,
                     state: dict[str, Any], hooks: Hooks, now: float) -> None:
    ck = spec.checkpoint
    last_step, created = _latest_checkpoint(ckpt_uri)
    start = attempt.start_steps.get(0) if attempt.start_steps else int(beat.get("start_step", 0))
    since = now - max(created or 0.0, attempt.launched_at)
    why = heartbeat.checkpoint_stale(int(beat.get("step", 0)), max(last_step or 0, start or 0), ck.every_steps,
                                     since, ck.every_minutes * 60 if ck.every_minutes else None)
    if why is None:
        state["alerted"] = False
    elif not state["alerted"]:
        state["alerted"] = True
        hooks.info(f"{stage}: ALERT checkpoint stale: {why}")
        if hooks.on_alert is not None:
            hooks.on_alert("checkpoint.stale", {"stage": stage, "reason": why, "step": beat.get("step"),
                                                "last_checkpoint_step": last_step})


def _result_status(stage_dir: Path) -> str | None:
    try:
        return json.loads((stage_dir / "result.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


def _stop_error(cause: str | None, detail: str, result: proc.ProcResult) -> str:
    tail = "\n".join(result.tail[-TAIL_LINES:])
    return f"{cause}: {detail}\n--- last {min(TAIL_LINES, len(result.tail))} log lines ---\n{tail}"


def _write_state(stage_dir: Path, attempts: list[Attempt], final: dict[str, Any] | None) -> None:
    path = stage_dir / STATE_FILE
    meta = json.loads(path.read_text()).get("launch", {}) if path.exists() else {}
    data = {"launch": meta, "attempts": [asdict(a) for a in attempts], "final": final}
    tmp = stage_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(stage_dir / STATE_FILE)


def _finish(stage_dir: Path, attempts: list[Attempt], result: proc.ProcResult, status: str, error: str | None,
            stop_reason: str | None, cause: str | None = None) -> Supervision:
    s = Supervision(status, cause, error, attempts, result, stop_reason)
    _write_state(stage_dir, attempts, {"status": status, "cause": cause, "error": error, "stop_reason": stop_reason})
    return s


def read_state(stage_dir: Path) -> dict[str, Any] | None:
    """What a supervisor wrote about a stage (for `traingate resume` and drills)."""
    try:
        return json.loads((stage_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
