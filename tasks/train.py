"""The one launch task: a StageJob's process tree, supervised to its end.

Ladder stages, resumes and sweep trials all start their training here. The restart policy
lives in :mod:`traingate.supervision`; this task plugs Prefect into it: restarts become
``traingate.run.restarted`` events (Automations can act on them), every alert (a stale checkpoint
among them) a ``traingate.alert.<rule>`` event, and cancelling the flow run preempts the tree (SIGTERM,
grace for the emergency checkpoint, SIGKILL) and returns a ``preempted`` StageResult: the
calling flow records it and ends ``Cancelled`` so the run shows as cancelled, resumable.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from mlflow.exceptions import MlflowException
from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NONE
from prefect.events import emit_event
from prefect.runtime import flow_run

from tasks import slots, slurm
from tasks.progress import ProgressArtifact
from traingate.capacity.pools import CapacityConfig, Engine
from traingate.cost import charged
from traingate.cost.budget import BudgetLeft, Scope, tightest
from traingate.cost.ledger import Attempt
from traingate.cost.source import budgets_for
from traingate.job.result import StageResult
from traingate.job.stagejob import StageJob
from traingate.job.vocab import Status
from traingate.ladder import outcomes, stage_run
from traingate.redact import redact_tree
from traingate.runtime.warm import Zygote
from traingate.settings import Settings
from traingate.supervision.supervisor import Hooks, Supervision, read_state, stop_request
from traingate.tracking import runs

CANCEL_POLL_S = 2.0


class Watcher(Protocol):
    """Something that looks at a running stage every tick (a sweep trial's pruner)."""

    def tick(self) -> str | None:
        """A reason to stop the tree now, or None."""


@task(name="train-stage", task_run_name="{job.stage}", cache_policy=NONE, retries=0)
def run_stage_job(
    job: StageJob,
    resume: bool = False,
    watcher: Watcher | None = None,
    zygote: Zygote | None = None,
    launched: Callable[[], None] | None = None,
    ended: Callable[[], None] | None = None,
    capacity: Callable[[], CapacityConfig | None] | None = None,
    beside: Callable[[Callable[[], object]], None] | None = None,
) -> StageResult:
    """Train one StageJob. ``resume``: continue an interrupted stage from its latest checkpoint. ``zygote``: the
    stage's or its run's, started ahead of time (:func:`traingate.supervision.drivers.start_zygote`); released
    unused on a Slurm pool, whose job starts its own processes. ``launched``: called once, as the stage's
    processes have started (or as it ends without them, or before a Slurm pool takes it): the caller's work that
    is to stay off the stage's start. ``ended``: called as each launch's processes have ended, before they are
    judged: the caller's work that is to stay off the stage's end. ``capacity``: the pools config, read by the
    caller beside its own preparation of the stage (:func:`read_capacity_config`); None: read here. ``beside``: runs
    a call of the stage's end beside the caller's next steps (the progress artifact's last update, an API call the
    gate does not read), and the caller waits for it before its own end; None: called here.

    On a server with a capacity config (``traingate pools bootstrap``) the job first waits in its
    pool's queue for all of its slots (``tasks/slots.py``), holds them while it trains, and gives
    them back on every exit path. A higher class that preempts it stops it at an emergency
    checkpoint; it then waits in the queue again and resumes by itself: same run, same MLflow run.
    """
    once = _Once(launched)
    try:
        return _run_stage_job(job, resume, watcher, zygote, once, ended, capacity, beside)
    finally:
        once()


class _Once:
    def __init__(self, call: Callable[[], None] | None):
        self.call = call

    def __call__(self) -> None:
        call, self.call = self.call, None
        if call is not None:
            call()


def _in_turn(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        then()

    return both


def read_capacity_config() -> CapacityConfig | None:
    """The pools config on the Prefect server (``traingate pools bootstrap``), None without one."""
    with get_client(sync_client=True) as client:
        return slots.read_config(client)


def _run_stage_job(
    job: StageJob,
    resume: bool,
    watcher: Watcher | None,
    zygote: Zygote | None,
    launched: _Once,
    ended: Callable[[], None] | None,
    capacity: Callable[[], CapacityConfig | None] | None,
    beside: Callable[[Callable[[], object]], None] | None,
) -> StageResult:
    log = get_run_logger()
    stage_dir = Path(job.stage_dir)
    previous = read_state(stage_dir) if resume else None
    with get_client(sync_client=True) as client:
        config = capacity() if capacity is not None else slots.read_config(client)
        pool = config.pools.get(job.pool) if config is not None else None
        if pool is not None and pool.engine == Engine.SLURM:  # Slurm schedules it: no gang slots of ours
            if zygote is not None:
                zygote.release()
            job = _with_budget(job, config, log)
            progress = ProgressArtifact(job)
            launched()  # the Slurm pool starts its processes: nothing here to keep off their start
            # Polled every tick of the follow loop; the progress artifact's tick never asks for a stop.
            stops = _either(
                stop_request, _cancel_watch(client), watcher.tick if watcher is not None else None, progress.tick
            )
            slurm_result = slurm.run_on_slurm(job, pool, resume, stops, log)
            progress.publish()
            return slurm_result
    gang = slots.for_job(job, config, say=log.info)
    with get_client(sync_client=True) as client:
        job = _with_budget(job, config, log)
        cancelled = _cancel_watch(client)
        stopping = _either(stop_request, cancelled)
        progress = ProgressArtifact(job)
        hooks = Hooks(
            on_tick=_in_turn(launched, progress.tick),  # the first tick comes right after the launch
            on_exit=ended,
            on_line=log.info,
            info=log.info,
            error=log.error,
            on_restart=lambda e: _emit("traingate.run.restarted", job, e),
            on_alert=lambda name, e: _alert(name, job, e, log),
            stop_requested=_either(
                stop_request,
                cancelled,
                watcher.tick if watcher is not None else None,
                gang.preempt_requested if gang is not None else None,
            ),
        )
        t0 = time.monotonic()
        preemptions = 0
        before: list[Supervision] = []  # smoke's first half: its attempts are charged too
        if gang is not None:
            launched()  # the queue may hold the stage: what waits for its launch starts now
        while True:
            if gang is not None and (why := gang.acquire(stopping)) is not None:
                if zygote is not None:
                    zygote.release()
                return _never_started(job, why, time.monotonic() - t0)
            try:
                sup = _train(job, hooks, previous, log, before, zygote)
                if zygote is not None and not zygote.shared:
                    zygote = None  # its supervision stopped it; a requeued run starts another
            except BaseException:
                if gang is not None:
                    gang.release()
                raise
            requeue = (
                gang is not None
                and gang.preempted_by is not None
                and sup.status == Status.PREEMPTED
                and stopping() is None
            )
            if gang is not None:
                gang.release(requeue=requeue)
            if not requeue:
                break
            log.warning(
                "%s preempted %s by %s (%s): back in the queue, resumes when slots are free",
                job.stage,
                "at a checkpoint" if sup.checkpointed is not False else "(its emergency checkpoint not confirmed)",
                (gang.preempted_by_last if gang is not None else None) or "a higher priority class",
                sup.error,
            )
            _emit("traingate.run.preempted", job, {"reason": sup.stop_reason, "error": sup.error})
            preemptions += 1
            previous = read_state(stage_dir)
    held = time.monotonic() - t0 - (gang.waited_s if gang is not None else 0.0)
    result = outcomes.from_supervision(job, sup, held, before=before)
    # The stage's end: its last step, loss and status.
    if beside is not None:
        beside(progress.publish)
    else:
        progress.publish()
    charged.record(stage_dir, result.attempts, final=True)  # what `traingate watch` adds up for the ended stage
    if gang is not None:
        result.metrics.update(preemptions=preemptions, queue_wait_s=round(gang.waited_s, 3))
    if sup.error:
        log.error("%s: %s", job.stage, sup.error)
    return result


def _train(
    job: StageJob, hooks: Hooks, previous: Any, log: Any, before: list[Supervision], zygote: Zygote | None
) -> Supervision:
    return stage_run.train(job, hooks, previous, log.info, before, zygote)


def _with_budget(job: StageJob, config: CapacityConfig | None, log: Any) -> StageJob:
    """The tightest budget over this stage (the run's ``budget.max_run_usd``; the team's per period from
    the pools config on the server), with what its scope spent before the stage: the supervisor warns
    at 80% and pauses the stage when it is crossed."""
    if job.budget_usd is not None:
        return job
    found: list[BudgetLeft] = []
    if job.spec.budget.max_run_usd is not None:
        # From the run directory: it also holds this stage's earlier attempts, which MLflow does not yet.
        found.append(_run_budget(job.spec, job.run_id, charged.run_usd(Path(job.run_dir))))
    found += _team_budget(job.spec, job.run_id, config, log)
    b = tightest(found)
    if b is None:
        return job
    log.info("%s: budget: %s, $%.4g of $%.4g spent before this stage", job.stage, b.label, b.spent_usd, b.limit_usd)
    return dataclasses.replace(job, budget_usd=b.limit_usd, budget_scope=str(b.scope), spent_before_usd=b.spent_usd)


def budgets_at_gate(
    spec: Any,
    run_id: str,
    run_dir: str | Path,
    result: StageResult,
    settle: Callable[[], None] = lambda: None,
    capacity: Callable[[], CapacityConfig | None] = read_capacity_config,
) -> list[BudgetLeft]:
    """What is left of each budget when the gate after ``result``'s stage decides (the gate refuses the
    next stage when its estimate does not fit): the run's from its stage directories (this stage's every
    attempt included), the team's from the tracking store. ``settle``: waits for the run's earlier stages
    to be recorded there (called only when a team budget applies). ``capacity``: the pools config (its team
    budgets), read as the stage ended (the default reads it now)."""
    log = get_run_logger()
    found: list[BudgetLeft] = []
    if spec.budget.max_run_usd is not None:
        spent = charged.run_usd(Path(run_dir), but=result.stage) + (result.cost_usd or 0.0)
        found.append(_run_budget(spec, run_id, spent))
    config = capacity()
    found += _team_budget(
        spec, run_id, config, log, settle, pending=[Attempt.from_record(run_id, r) for r in result.attempts]
    )
    return found


def _run_budget(spec: Any, run_id: str, spent_usd: float) -> BudgetLeft:
    return BudgetLeft(
        Scope.RUN,
        run_id,
        spec.budget.max_run_usd,
        spent_usd,
        "raise budget.max_run_usd (traingate resume RUN_ID --set budget.max_run_usd=...)",
    )


def _team_budget(
    spec: Any,
    run_id: str,
    config: CapacityConfig | None,
    log: Any,
    settle: Callable[[], None] = lambda: None,
    pending: list[Attempt] | None = None,
) -> list[BudgetLeft]:
    """The team's budget for the current period (``config``: the pools config on the server), from its recorded
    runs."""
    team = spec.identity.team
    if config is None or team not in config.team_budgets:
        return []
    settle()
    try:
        return [
            b
            for b in budgets_for(
                runs.client(Settings.from_env().tracking_uri),
                spec,
                run_id,
                time.time(),
                config.team_budgets,
                pending=pending or (),
            )
            if b.scope == Scope.TEAM
        ]
    except (MlflowException, OSError) as e:
        log.warning("team budget of %s not checked: tracking store unreachable (%s)", team, e)
        return []


def _never_started(job: StageJob, why: str, waited_s: float) -> StageResult:
    """Cancelled while it waited for slots: nothing ran, nothing to pay; resumable as preempted."""
    return StageResult(
        stage=job.stage,
        status=Status.PREEMPTED,
        metrics={"restarts": 0},
        cost_usd=0.0,
        duration_s=waited_s,
        checkpoint_uri=None,
        estimate={},
        details={"waited_s": waited_s},
        error=f"stopped while waiting for slots: {why}",
    )


def _either(*checks: Callable[[], str | None] | None) -> Callable[[], str | None]:
    live = [c for c in checks if c is not None]

    def check() -> str | None:
        for c in live:
            if (why := c()) is not None:
                return why
        return None

    return check


def _emit(event: str, job: StageJob, payload: dict[str, Any], **labels: str) -> None:
    """A Prefect event on the run's resource; ``labels`` are further resource labels Automations can match."""
    emit_event(
        event=event,
        resource={
            "prefect.resource.id": f"traingate.run.{job.run_id}",
            "traingate.stage": job.stage,
            "traingate.kind": str(job.kind),
            **{f"traingate.{k}": v for k, v in labels.items()},
        },
        payload=redact_tree(payload),
    )


def _alert(name: str, job: StageJob, payload: dict[str, Any], log: Any) -> None:
    """An alert or a roll-back: a Prefect event (Automations notify or act on it) and, for an alert
    rule's firing, a tag and a metric on the stage's MLflow run."""
    labels = {"severity": str(payload["severity"]), "action": str(payload["action"])} if "severity" in payload else {}
    _emit(f"traingate.{name}", job, payload, **labels)
    if not name.startswith("alert.") or not job.tracking_uri or not job.mlflow_run_id:
        return
    rule = payload["rule"]
    try:
        client = runs.client(Settings.from_env().tracking_uri)
        client.set_tag(job.mlflow_run_id, f"traingate.alert.{rule}", f"{payload['message']} -> {payload['outcome']}")
        client.log_metric(job.mlflow_run_id, f"alerts/{rule}", 1.0, step=int(payload["at"]))
    except (MlflowException, OSError) as e:
        # The tracking store being down must not take the supervision with it; the alert is in
        # alerts.jsonl, the logbook and the event.
        log.warning("alert %s not recorded in MLflow: %s", rule, e)


def _cancel_watch(client: Any) -> Callable[[], str | None]:
    """A poll of this flow run's state: a reason once it is being cancelled, else None.

    A flow run cancelled from the UI/API while it runs in this process gets no signal
    (only a worker's runner would send one), so the supervisor asks.
    """
    run_id = flow_run.id
    last = [0.0]

    def check() -> str | None:
        if not run_id or time.monotonic() - last[0] < CANCEL_POLL_S:
            return None
        last[0] = time.monotonic()
        state = client.read_flow_run(run_id).state
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            return f"flow run {run_id} is {state.name.lower()}"
        return None

    return check
