"""The ladder: unit -> smoke -> canary -> full, a gate after each stage. Run, or resume.

``ladder`` is THE ladder loop: `traingate run`, `traingate resume`, deployments from the
Prefect UI (its RunSpec parameter renders as a form) and CI all come through it.
``pipeline`` is the thin entry for a spec file plus ``--set`` overrides.
"""

from __future__ import annotations

import collections
import contextvars
import copy
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated, Any, NamedTuple, TypeVar, cast
from uuid import UUID, uuid4

from prefect import flow, get_client, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.blocks.system import Secret
from prefect.context import FlowRunContext, SettingsContext, SyncClientContext, get_settings_context
from prefect.exceptions import FlowPauseTimeout, ObjectNotFound
from prefect.flow_runs import pause_flow_run
from prefect.futures import PrefectFuture
from prefect.input import RunInput
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled, Completed, Crashed, Failed, Running, State
from prefect.utilities.annotations import quote
from pydantic import BaseModel, ConfigDict, Field, create_model

from flows import prefect_tls
from tasks.data import data_snapshot, newest_snapshot
from tasks.report import publish_stage_report
from tasks.slots import CONFIG_VAR, read_config
from tasks.tracking import (
    close_pipeline_run,
    create_stage_run,
    fill_pipeline_run,
    fill_stage_run,
    gate_passed,
    open_pipeline_run,
    record_stage,
    register_candidate,
)
from tasks.train import budgets_at_gate, read_capacity_config, run_stage_job
from tasks.unit import run_unit_tests, start_unit_tests
from traingate.capacity import entitlements
from traingate.capacity.pools import BUILTIN_CLASSES, CapacityConfig, CapacityError, priority_class
from traingate.capacity.slurm import SlurmError
from traingate.capacity.slurm_cli import check_pool_entitled
from traingate.job.files import read_result
from traingate.job.result import GateDecision, StageResult
from traingate.job.stagejob import derive
from traingate.job.vocab import Status
from traingate.ladder.gates import decide, over_budget_only
from traingate.ladder.outcomes import reestimated, resumable_stop
from traingate.ladder.plan import ResumePoint, record_flow_run, resume_point, run_of_flow_run, stages_until
from traingate.ladder.preflight import check_spec, preflight
from traingate.launch.warm_pytest import WarmPytest
from traingate.promotion.refusal import refusal
from traingate.redact import redact, register_secret
from traingate.settings import SECRET_BLOCKS_VAR, LocationError, Settings, code_dir, for_deployment, secret_blocks
from traingate.snapshots import has_latest
from traingate.spec import RunSpec, SpecError, Stage, load_spec, write_resolved
from traingate.specbase import MAX_SECONDS, form_positions
from traingate.supervision.drivers import start_zygote
from traingate.tracking import runs as tracking_runs
from traingate.tracking import stale
from traingate.tracking.identity import code_version, commit_mismatch

T = TypeVar("T")
# The longest a stage's end keeps the run's tracking writes waiting (Beside.hold): the ladder's own work between
# a stage's processes and the next launch takes a tenth of a second; a pause, a restart's backoff, a queue may not.
HOLD_S = 1.0


class RunStopped(Exception, Mapping[str, Any]):
    """A ladder (or a flow wrapping one) that did not finish: the data of its Failed or Cancelled state.

    Its message is the state's (a gate's reasons, a rejection, a preemption with its resume
    command); read by key it is the run's summary, as a Completed state's data is. It must be an
    exception: a deployment's engine re-raises a failed flow run's data, and a plain dict there
    is Prefect's `TypeError: Unexpected result for failed state` with a traceback in the run's logs.
    """

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message, summary)  # both in args: the result store pickles it by its args
        self.message, self.summary = message, summary

    def __str__(self) -> str:
        return self.message

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.summary)

    def __len__(self) -> int:
        return len(self.summary)

    __hash__ = Exception.__hash__  # Mapping's __eq__ would make it unhashable; tracebacks keep exceptions in sets


class _OutcomeNotFault(logging.Filter):
    """Drop the engine's traceback of a run that stopped on purpose.

    Run from a deployment, Prefect's engine re-raises a Failed or Cancelled flow run's data and logs
    it as "Engine execution exited with unexpected exception" with a traceback, after the run's state
    and its "Finished in state Failed('<reason>')" line have said everything. A gate that refuses is
    an outcome, not a fault; exceptions of any other type keep their tracebacks.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], RunStopped))


# The engine logs through the flow-run logger before it hands the exception back; its filters are
# the one place that sees the record for every handler (console, Prefect's API). Added once.
_FILTER = _OutcomeNotFault()
if not any(isinstance(f, _OutcomeNotFault) for f in logging.getLogger("prefect.flow_runs").filters):
    logging.getLogger("prefect.flow_runs").addFilter(_FILTER)
prefect_tls.install()  # every Prefect client of a run shares one verified TLS context per CA file


def stopped(state: State, summary: dict[str, Any]) -> State:
    """``state`` (Failed or Cancelled) carrying ``summary`` as a :class:`RunStopped`."""
    state.data = RunStopped(state.message or state.name or "", summary)
    return state


def with_newest_data(spec: RunSpec) -> RunSpec:
    """``spec`` with ``data.uri``'s ``{latest}`` resolved to the newest version, once per run: its identity and
    every stage read that version. Every flow that starts a run calls it; the CLI resolves through the same
    :func:`traingate.snapshots.resolve_spec` (the task wraps it), so a deployment and `traingate run` of one
    spec train on the same version."""
    return newest_snapshot(spec) if has_latest(spec.data.uri) else spec


_CHECKED: dict[int, RunSpec] = {}  # specs a command checked in this process for the ladder it starts next


def checked_here(spec: RunSpec) -> None:
    """A command has checked ``spec`` in this process as the ladder would (its newest data resolved, its checks,
    the preflight, the entitlement) and starts the ladder with it next: the ladder does not check it again. A
    flow run started otherwise (a deployment's, a retry's) has a spec of its own and is checked."""
    _CHECKED[id(spec)] = spec


def check_entitled(spec: RunSpec) -> None:
    """The spec's priority class is one of the pools config's (this Prefect server's; without one, the built-in
    classes), or one CapacityError line naming the valid ones. On a Slurm pool of that config: the submitting
    user's Slurm associations grant the spec's team and priority class, or one SlurmError line naming the
    account or QOS and the fix. `traingate run` calls it before the flow run; the ladder calls it for what a
    deployment hands it."""
    with get_client(sync_client=True) as client:
        config = read_config(client)
    # The class exists before anyone is asked whether it may be used (a Slurm pool's classes are its QOS).
    priority_class(config, spec.resources.priority, f"Prefect variable {CONFIG_VAR}" if config else BUILTIN_CLASSES)
    check_pool_entitled(config, spec.resources.work_pool, spec.identity.team, spec.resources.priority)
    # A local pool: the pools file's entitlements for this OS user (a stage's width is checked when it is admitted).
    entitlements.check(
        config, entitlements.os_user(), spec.identity.team, spec.resources.priority, spec.resources.work_pool, 0
    )


def summary_of(state: State) -> dict[str, Any] | None:
    """The summary a ladder (or a flow that wraps one) ended with, however it ended; None if it crashed."""
    data = state.result(raise_on_failure=False)
    if isinstance(data, RunStopped):
        return data.summary
    return data if isinstance(data, dict) else None


class Approval(RunInput):
    approve: bool
    reviewer: str = ""
    reason: str = ""


class Resume(RunInput):
    """The Resume form the Prefect UI shows on a ladder paused mid-stage (an alert, a budget, a full disk)."""

    model_config = ConfigDict(json_schema_extra=form_positions)

    resume: bool = Field(
        default=True,
        description="continue the paused stage from its latest checkpoint; false: stop (`traingate resume` "
        "can still continue it)",
    )
    overrides: list[str] = Field(
        default_factory=list,
        description="spec changes for the rest of the run, e.g. budget.max_run_usd=20 after a budget pause",
    )
    reviewer: str = ""
    reason: str = ""

    def changes(self) -> list[str]:
        """The spec changes this answer asks for, as ``--set`` overrides."""
        return list(self.overrides)


class BudgetResume(RunInput):
    """The Resume form the Prefect UI shows on a ladder whose gate refused the next stage on its budget alone:
    a budget the stage's estimate fits in starts it. Its description names the estimate and the budgets."""

    model_config = ConfigDict(json_schema_extra=form_positions)

    resume: bool = Field(
        default=True,
        description="start the next stage once its estimate fits the budget; false: stop (`traingate resume` "
        "can still start it)",
    )
    max_run_usd: float | None = Field(default=None, gt=0, description="budget.max_run_usd: the run's budget, $")
    max_cost_usd: float | None = Field(
        default=None, gt=0, description="budget.max_cost_usd: the most one stage may be estimated to cost, $"
    )
    overrides: list[str] = Field(
        default_factory=list,
        description="other spec changes for the rest of the run, e.g. stages.full.max_steps=5000",
    )
    reviewer: str = ""
    reason: str = ""

    @classmethod
    def starting_at(cls, description: str, **budgets: float | None) -> type[BudgetResume]:
        """The form with ``description`` (markdown above it) and ``budgets`` (the run's own) as its fields' defaults.
        RunInput.with_initial_data would drop the fields' descriptions and bounds from the schema the UI draws."""
        fields: dict[str, Any] = {}
        for name, value in budgets.items():
            field = copy.copy(cls.model_fields[name])
            field.default = value
            fields[name] = (field.annotation, field)
        form = create_model(cls.__name__, __base__=cls, **fields)
        return form.with_initial_data(description=description)

    def changes(self) -> list[str]:
        """The budgets given (the form starts at the run's own) and the other spec changes, as ``--set`` overrides."""
        given = {"budget.max_run_usd": self.max_run_usd, "budget.max_cost_usd": self.max_cost_usd}
        return [f"{k}={v!r}" for k, v in given.items() if v is not None] + list(self.overrides)


class UiResume(NamedTuple):
    """What came of a pause in place: the spec to continue with, or why the run stops (``elsewhere``: another
    orchestrator, `traingate resume`, took the run over while it waited)."""

    spec: RunSpec | None
    why: str = ""
    elsewhere: bool = False


class ResumeFrom(BaseModel):
    """Continue an earlier run: its interrupted stage from the latest checkpoint, then the rest."""

    model_config = ConfigDict(json_schema_extra=form_positions)  # the run form keeps this order on PostgreSQL

    run_id: str = Field(min_length=1, description="the traingate run id (`traingate run` printed it)")
    stage: Stage | None = Field(default=None, description="default: the run's first unfinished training stage")
    overrides: list[str] = Field(
        default_factory=list,
        description="spec changes for the rest of the run, e.g. "
        "budget.max_run_usd=20 after a budget pause (a checkpoint refuses changes it "
        "depends on)",
    )


# Its outcome is the run's directory and MLflow runs; the state it returns is read in the process that ran it, so it
# is not persisted (and a top-level run does not ask the server for its default persistence as it starts).
@flow(name="ladder", log_prints=True, persist_result=False)
def ladder(
    spec: RunSpec | None = None,
    until: Stage = "full",
    resume_from: ResumeFrom | None = None,
    pause_wait_s: Annotated[int, Field(ge=0, le=int(MAX_SECONDS))] = 0,
) -> State:
    """Run ``spec`` up the ladder to ``until``; or, with ``resume_from``, continue that run.

    ``pause_wait_s``: how long a stage paused by an alert or a budget waits, paused in Prefect, for its
    Resume form (:class:`Resume`) before the run stops resumable; 0 (the CLI): it stops at once, and
    `traingate resume` continues it.
    """
    log = get_run_logger()
    try:
        settings = flow_settings()
    except LocationError as e:
        return stopped(Failed(message=str(e)), {})
    if resume_from is None and (started := run_of_flow_run(settings, str(flow_run.id))) is not None:
        # Prefect's Retry runs this flow run again with its parameters: continue the run it started.
        log.info("flow run %s retried: continuing run %s from its last completed stage", flow_run.id, started)
        resume_from = ResumeFrom(run_id=started)
    warm_unit: WarmPytest | None = None
    if spec is not None and resume_from is None:  # validation once, before anything is created
        if _CHECKED.pop(id(spec), None) is not spec:
            spec = with_newest_data(spec)
            check_spec(spec)
            preflight(spec, settings)
            try:
                check_entitled(spec)
            except (SlurmError, CapacityError) as e:
                return stopped(Failed(message=str(e)), {})
        # The unit stage's interpreter loads pytest and the tests' imports beside the data snapshot and the
        # MLflow runs; it runs nothing before run_unit_tests hands it its arguments.
        warm_unit = start_unit_tests(spec)
    settings.ensure()
    beside = Beside()  # what runs beside the ladder (tracking writes, API calls), settled before the run ends
    # Orchestrator death (see traingate.tracking.stale): a resume's own run is closed first; a new run's sweep
    # runs beside it, from its first launch on.
    if resume_from is not None:
        _close_stale_runs(settings)
        point = resume_point(settings, resume_from.run_id, resume_from.stage)
        spec, run_id = point.spec, point.run_id
        if resume_from.overrides:
            spec = spec.with_overrides(resume_from.overrides)
            write_resolved(spec, settings.state_dir / "runs" / run_id / "spec.yaml")  # later resumes see them
        stages = [s for s in stages_until(until) if s in point.remaining]
    elif spec is not None:
        beside.after_next_launch(lambda: [beside.fetch(_close_stale_runs, settings)])
        point = None
        data_hash, data_uri = data_snapshot(_as_is(spec))
        # Its tags now (its stage runs inherit them); its params, identity artifacts and the stored identity's
        # verdict from the first launch on, before any stage run copies them.
        run_id = open_pipeline_run(_as_is(spec), data_hash, data_uri, validate=False, fill=False)
        beside.after_next_launch(_submitting(fill_pipeline_run, run_id, _as_is(spec)))
        write_resolved(spec, settings.state_dir / "runs" / run_id / "spec.yaml")
        record_flow_run(settings, str(flow_run.id), run_id)  # after spec.yaml: a retry finds a resumable run
        stages = stages_until(until)
    else:
        raise SpecError("ladder: pass a spec, or resume_from with a run id")
    beside.thread(_name_flow_run, run_id if point is None else f"{run_id}-resume")
    run_dir = settings.state_dir / "runs" / run_id
    stale.claim(run_dir, str(flow_run.id))  # this process now runs the pipeline (a resume takes it over)
    summary: dict[str, Any] = {
        "run_id": run_id,
        "flow_run_id": str(flow_run.id),
        "stages": {},
        "run_dir": str(run_dir),
        "resumed": point is not None,
    }
    if not stages:
        beside.settle()
        if (
            point is not None
            and until == "full"
            and "full" in point.mlflow_run_ids
            and gate_passed(point.mlflow_run_ids["full"])
        ):
            # Every stage ran but the orchestrator died before the end: promote and close, as it would have.
            full = read_result(run_dir / "full")
            summary["model"] = register_candidate(
                _as_is(spec), point.mlflow_run_ids["full"], full.checkpoint_uri if full else None, run_id=run_id
            )
            promotion = _promotion(run_id, summary["model"], beside)
            close_pipeline_run(run_id, True, "full")
            beside.settle()
            return Completed(message=f"run {run_id}: every stage had passed; {promotion}", data=summary)
        return Completed(message=f"run {run_id}: nothing left to run up to {until}", data=summary)
    # The run's zygote (supervision.warm_restarts): the training stack imported once, beside the unit stage, and
    # every training stage on this host forks its workers from it; unused (a failed unit gate), it only imported.
    first_training = next((s for s in stages if s != "unit"), None)
    zygote = (
        start_zygote(derive(spec, first_training, run_id=run_id, run_dir=run_dir, settings=settings), shared=True)
        if first_training is not None
        else None
    )
    end = _StageEnd(beside)

    def train(job: Any, resume: bool, capacity: Callable[[], CapacityConfig | None] | None = None) -> StageResult:
        """A training stage with the ladder's hooks: the kept writes go on at its launch and wait at its end, the
        gate's config is read as it ends, its last progress update runs beside what follows."""
        return run_stage_job(
            _as_is(job),
            resume=resume,
            zygote=zygote,
            launched=beside.launched,
            ended=end.ended,
            capacity=capacity,
            beside=beside.thread,
        )

    try:
        for i, stage in enumerate(stages):
            resuming = point is not None and stage == point.stage
            in_place: UiResume | None = None  # the stage's pause in place, if it paused
            known_run = point.mlflow_run_ids.get(stage) if point is not None and resuming else None
            if stage == "unit":  # its MLflow run is created beside its pytest run: the tests need none of it
                end.read_now()  # the gate's pools config, beside the tests
                creating = None if known_run else create_stage_run.submit(run_id, stage)
                result = run_unit_tests.with_options(task_run_name=stage)(
                    _as_is(spec), str(run_dir / "spec.yaml"), str(run_dir / stage), warm=warm_unit
                )
                stage_run = known_run or cast(PrefectFuture, creating).result()
                if not known_run:
                    beside.after_next_launch(_submitting(fill_stage_run, run_id, stage_run, stage))
            else:
                # A training stage needs its run's id and tags before it starts; the rest (spec params, identity
                # artifacts, the dataset input) is written once it has launched, settled with its recording. The
                # pools config is read while its run is created.
                capacity = beside.fetch(read_capacity_config)
                stage_run = known_run or create_stage_run(run_id, stage)
                if not known_run:
                    beside.after_next_launch(_submitting(fill_stage_run, run_id, stage_run, stage))
                job = derive(spec, stage, run_id=run_id, run_dir=run_dir, settings=settings, mlflow_run_id=stage_run)
                result = train(job, resuming, capacity.result)
                while pause_wait_s > 0 and _paused(result):  # the Prefect UI's Resume form continues it here
                    in_place = _wait_for_resume(
                        stage, spec, run_dir, pause_wait_s, Resume, resumable_stop(stage, result, run_id)
                    )
                    if in_place.spec is None:
                        break
                    spec = in_place.spec
                    job = derive(
                        spec, stage, run_id=run_id, run_dir=run_dir, settings=settings, mlflow_run_id=stage_run
                    )
                    result = train(job, True)
            gate = spec.gate(stage)
            decision = _decide(spec, result, run_id, run_dir, beside, end.capacity)
            refused_on_budget = i + 1 < len(stages) and over_budget_only(result, gate, decision)
            if pause_wait_s > 0 and refused_on_budget:  # the Prefect UI's Resume form gives the next stage a budget
                in_place = _wait_for_budget(stages[i + 1], result, decision, spec, run_dir, pause_wait_s, beside)
                if in_place.spec is not None:
                    spec = in_place.spec
                    result = reestimated(result, spec)
                    decision = _decide(spec, result, run_id, run_dir, beside)
            # Recording runs beside the next stage (MLflow writes, plots, the report), from its launch on: the gate
            # needs none of it, and the next stage's start does not share the process with it. After the run's
            # last stage nothing launches: its report (an API call, read by nothing after it) goes out now, beside
            # its MLflow records and the promotion that reads them.
            last = i + 1 == len(stages)
            beside.after_next_launch(functools.partial(_record, stage_run, result, decision, run_id, report=not last))
            if last:
                beside.thread(publish_stage_report.fn, run_id, result, decision, stage_run)
            summary["stages"][stage] = {
                "status": str(result.status),
                "gate": decision.passed,
                "mlflow_run_id": stage_run,
                "checkpoint_uri": result.checkpoint_uri,
                "cost_usd": result.cost_usd,
                "restarts": result.metrics.get("restarts", 0),
                "resumed_from_step": result.metrics.get("resumed_from_step", 0),
            }
            summary["checkpoint_uri"] = result.checkpoint_uri or summary.get("checkpoint_uri")
            if result.status == Status.PREEMPTED:  # cancelled from the UI/API, or paused: checkpointed, resumable
                beside.settle()
                if in_place is not None and in_place.elsewhere:  # the orchestrator that took the run over closes it
                    return stopped(Cancelled(message=f"{stage}: {in_place.why}"), summary)
                not_resumed = in_place.why if in_place is not None else ""
                close_pipeline_run(run_id, False, stage, result.error or "preempted")
                message = resumable_stop(stage, result, run_id) + (f" ({not_resumed})" if not_resumed else "")
                return stopped(Cancelled(message=message), summary)
            if not decision.passed:
                beside.settle()
                if in_place is not None and in_place.elsewhere:  # the orchestrator that took the run over closes it
                    return stopped(Cancelled(message=f"{stage}: {in_place.why}"), summary)
                message = decision.summary()
                if in_place is not None and refused_on_budget:  # not resumed from the form: the terminal's way on
                    message += f" ({in_place.why}; {_resume_hint(spec, run_id, stages[i + 1])})"
                close_pipeline_run(run_id, False, stage, message)
                return stopped(Failed(message=message), summary)
            log.info(decision.summary())
            if gate.require_approval and i + 1 < len(stages):
                # WARNING: a person must act, and the terminal shows traingate's records from WARNING up.
                log.warning(
                    "paused for approval: %s passed its gate (gates.%s.require_approval); %s starts when a reviewer "
                    "resumes flow run %s with {approve: true, reviewer, reason} (Prefect UI: Resume), within %d s",
                    stage,
                    stage,
                    stages[i + 1],
                    flow_run.id,
                    int(gate.approval_timeout_s),
                )
                beside.launched()  # the recording starts now: a reviewer may take hours
                answer = pause_flow_run(
                    wait_for_input=Approval, timeout=int(gate.approval_timeout_s), key=f"approve-{stages[i + 1]}"
                )
                if not answer.approve:
                    reason = (
                        f"promotion to {stages[i + 1]} rejected by {answer.reviewer or 'reviewer'}: {answer.reason}"
                    )
                    beside.settle()
                    close_pipeline_run(run_id, False, stage, reason)
                    return stopped(Failed(message=reason), summary)
                log.info("promotion to %s approved by %s", stages[i + 1], answer.reviewer or "reviewer")
        beside.settle(writes_only=True)  # the stages' records, which the promotion reads
        verb = (
            f"resumed {stages[0]}; reached {stages[-1]}"
            if point is not None
            else (f"all {len(stages)} stages passed" if len(stages) > 1 else f"{stages[0]} passed")
        )
        if stages[-1] == "full":  # promotion: registered only if the run's identity is complete
            summary["model"] = register_candidate(
                _as_is(spec), summary["stages"]["full"]["mlflow_run_id"], summary.get("checkpoint_uri"), run_id=run_id
            )
            verb += "; " + _promotion(run_id, summary["model"], beside)
        close_pipeline_run(run_id, True, stages[-1])
        beside.settle()  # the last stage's report, the promotion's artifact
        return Completed(message=verb, data=summary)
    finally:
        if zygote is not None:
            zygote.stop()


def flow_settings() -> Settings:
    """A flow run a worker started (from a deployment, or under one) takes its locations from its pool and
    refuses the embedded default, the directory its code was pulled into; a local run keeps the default."""
    if _under_deployment():
        settings = for_deployment()
        _children_import_this_code()
        load_secret_blocks()
        return settings
    return Settings.from_env()


def no_flow_heartbeats() -> AbstractContextManager[Any]:
    """Flow runs started in this context send no Prefect heartbeats: for a ladder run in the foreground (`traingate
    run`), whose liveness is its process's: the guardian stops what it leaves and the next run closes its flow run
    as Crashed (``_close_stale_runs``). A heartbeat thread sleeps in whole seconds and the flow's end waits for its
    sleep to finish (0-1 s a run).

    The current settings with that one value replaced (a copy that shares the rest): Prefect's
    ``temporary_settings`` would validate every setting again (20 ms)."""
    ctx = get_settings_context()
    current = ctx.settings
    flows = current.flows.model_copy(update={"heartbeat_frequency": None})
    return SettingsContext(profile=ctx.profile, settings=current.model_copy(update={"flows": flows}))


def one_client() -> AbstractContextManager[Any]:
    """This thread's Prefect API calls, a flow run's included, share one client in this context: a new client costs
    its connection and its CSRF token (its TLS context is the process's, :mod:`flows.prefect_tls`)."""
    return SyncClientContext.get_or_create()


def _under_deployment() -> bool:
    """Whether this flow run is a deployment's, or runs under one (ci-canary's pipeline -> ladder). A top-level
    flow run knows from the record its engine read as it started; Prefect's ``runtime.deployment.id`` would ask
    the server for that record again (0.05-0.1 s on every local run)."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None or ctx.flow_run.parent_task_run_id is not None:
        return deployment.id is not None
    return ctx.flow_run.deployment_id is not None


def load_secret_blocks() -> list[str]:
    """The credentials the pool names in ``TRAINGATE_SECRET_BLOCKS`` (``VAR=block``), from their Prefect
    Secret blocks into this flow run's environment (its stage processes inherit them), unless already
    set (a process worker's own environment). A container pool's flow runs get them no other way: a
    container does not inherit its worker's environment and job variables are readable by everyone."""

    loaded = []
    for var, block in secret_blocks(os.environ.get(SECRET_BLOCKS_VAR)).items():
        if os.environ.get(var):
            continue
        try:
            os.environ[var] = cast(Secret, Secret.load(block)).get()  # load() from sync code: the block
            register_secret(os.environ[var])  # masked wherever this process writes it, whatever VAR is called
        except ValueError as e:  # Prefect: "Unable to find block document named ..."
            raise LocationError(
                f"{SECRET_BLOCKS_VAR}: Secret block {block!r} (for ${var}) cannot be loaded ({e}); "
                "store it with `traingate pools secrets` where the credentials are set"
            ) from None
        loaded.append(var)
    return loaded


def _children_import_this_code() -> None:
    """Stage processes (torchrun's ranks, the unit stage's pytest) start in their stage directory, where a
    plain interpreter imports the *installed* traingate, not the code this run was pulled from (ci-canary's
    checkout of the commit under test). The code directory goes first on their PYTHONPATH."""
    here = str(code_dir())
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != here]
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *rest])


def _promotion(run_id: str, model: dict[str, Any], beside: Beside) -> str:
    """The promotion outcome in words, also as the run's last artifact (published ``beside`` the run's close): a
    refused promotion must not read as a plain success (the stages passed, but the run produced no candidate
    model)."""

    findings = ""
    if model.get("registered"):
        line = f"model promoted: models:/{model['name']}@{model['alias']} (version {model['version']})"
    else:
        line = refusal(model.get("reasons", []))
        findings = "".join(f"\n- {r}" for r in model.get("reasons", []))
        findings = f"\n## What the checks found\n{findings}\n" if findings else ""
    beside.thread(
        functools.partial(
            create_markdown_artifact,
            markdown=f"# Promotion of run {run_id}\n\n{redact(line)}\n{redact(findings)}",
            key=f"tg-{run_id}-5-promotion",
            description=f"traingate run {run_id}: promotion",
        )
    )
    return line


def _name_flow_run(name: str) -> None:
    """Name this flow run after the traingate run id (the MLflow parent run's id: known only once that
    run is open, so not a ``flow_run_name`` template), so the UI's list and the CLI's output match."""
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=name)


def _close_stale_runs(settings: Settings) -> None:
    """Close the MLflow runs and Prefect flow runs of pipelines whose orchestrator died, with the cause."""
    log = get_run_logger()
    with get_client(sync_client=True) as client:

        def state_of(flow_run_id: str) -> str | None:
            try:
                state = client.read_flow_run(UUID(flow_run_id)).state
            except ObjectNotFound:  # another Prefect server's run: judged by its pid alone
                return None
            return state.type.value if state is not None else None

        closed = stale.sweep(tracking_runs.client(settings.tracking_uri), settings.state_dir, state_of)
        for s in closed:
            log.warning(
                "run %s (%s%s) was left RUNNING by a dead orchestrator: closed as KILLED (%s)",
                s.mlflow_run_id,
                s.kind,
                f" {s.stage}" if s.stage else "",
                s.cause,
            )
        for flow_run_id, cause in {s.flow_run_id: s.cause for s in closed if s.flow_run_id}.items():
            # A Retry of a crashed flow run runs as that same flow run: its dead orchestrator is not this one.
            if flow_run_id != str(flow_run.id) and state_of(flow_run_id) in stale.LIVE_FLOW_STATES:
                client.set_flow_run_state(flow_run_id, Crashed(message=f"orchestrator lost: {cause}"), force=True)


def _paused(result: StageResult) -> bool:
    """A stage an alert, a budget or a full disk paused at a checkpoint (not one preempted or cancelled)."""
    return result.status == Status.PREEMPTED and bool(result.details.get("supervision", {}).get("paused_by"))


def _wait_for_resume(
    stage: str,
    spec: RunSpec,
    run_dir: Path,
    wait_s: int,
    form: type[Resume] | type[BudgetResume],
    stopped_line: str,
    verdict: Callable[[RunSpec], str] | None = None,
    action: str = "from its latest checkpoint",
) -> UiResume:
    """Pause this flow run with ``form`` (the Prefect UI's Resume button) for up to ``wait_s``.

    Resumed with ``resume: true``: the spec with the answer's changes (kept in the run's spec.yaml, as `traingate
    resume --set` keeps them); changes that do not make a valid spec, or that ``verdict`` refuses (it returns
    why, or ""), are refused in one line and the run pauses again. Declined, timed out, or taken over by
    `traingate resume` meanwhile: why it stops. ``stopped_line`` says why it paused and how the CLI continues it.
    """
    log = get_run_logger()
    while True:
        log.warning(
            "%s; or resume flow run %s from the Prefect UI (Resume: %s) within %d s",
            stopped_line,
            flow_run.id,
            ", ".join(f for f in form.model_fields if f != "resume"),
            wait_s,
        )
        try:
            answer = pause_flow_run(wait_for_input=form, timeout=wait_s, key=f"resume-{stage}-{uuid4().hex[:8]}")
        except FlowPauseTimeout:
            # The server keeps a timed-out pause Paused and turns any state the run proposes into "Failed: never
            # resumed"; forced back to Running, the run ends with its own state and summary.
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(
                    flow_run.id, Running(message=f"not resumed within pause_wait_s={wait_s} s"), force=True
                )
            return UiResume(None, f"not resumed within pause_wait_s={wait_s} s")
        owner = stale.read_orchestrator(run_dir)
        if owner is not None and owner.flow_run_id != str(flow_run.id):
            return UiResume(None, f"continued by flow run {owner.flow_run_id} (traingate resume)", elsewhere=True)
        who = answer.reviewer or "reviewer"
        if not answer.resume:
            return UiResume(None, f"not resumed by {who}" + (f": {answer.reason}" if answer.reason else ""))
        asked = answer.changes()
        try:
            changed = spec.with_overrides(asked)
        except SpecError as e:
            log.error("Resume of %s refused: overrides: %s; the run stays paused", stage, e)
            continue
        refused = verdict(changed) if verdict is not None else ""
        if refused:
            log.error("Resume of %s refused: asked %s: %s; the run stays paused", stage, ", ".join(asked), refused)
            continue
        write_resolved(changed, run_dir / "spec.yaml")  # a later `traingate resume` keeps them
        changes = "".join(f"; {o}" for o in asked)
        log.info("%s resumed by %s %s%s", stage, who, action, changes)
        return UiResume(changed)


def _decide(
    spec: RunSpec,
    result: StageResult,
    run_id: str,
    run_dir: Path,
    beside: Beside,
    capacity: Callable[[], CapacityConfig | None] = read_capacity_config,
) -> GateDecision:
    """The gate after ``result``'s stage under ``spec``: its rules, and the next stage's estimate against
    ``budget.max_cost_usd`` and what is left of the run's and the team's budgets (``capacity``: the pools config
    with the team budgets; the default reads it now)."""
    return decide(
        result,
        spec.gate(result.stage),
        spec.budget.max_cost_usd,
        budgets=budgets_at_gate(spec, run_id, run_dir, result, beside.settle, capacity),
    )


class _StageEnd:
    """What a stage's end starts as it happens: the run's tracking writes held (:meth:`Beside.hold`), and the pools
    config read for the gate (its team budgets): a server round trip while the stage's own end (its checkpoints,
    its progress) runs, not after it."""

    def __init__(self, beside: Beside) -> None:
        self.beside = beside
        self.config: Future[CapacityConfig | None] | None = None

    def ended(self) -> None:
        """A stage's ``ended`` hook (each launch's; the last one's read is the gate's)."""
        self.beside.hold()
        self.read_now()

    def read_now(self) -> None:
        self.config = Beside.fetch(read_capacity_config)

    def capacity(self) -> CapacityConfig | None:
        """The config read as the stage ended (read now if it was not)."""
        config, self.config = self.config, None
        return config.result() if config is not None else read_capacity_config()


def _wait_for_budget(
    nxt: str,
    result: StageResult,
    decision: GateDecision,
    spec: RunSpec,
    run_dir: Path,
    wait_s: int,
    beside: Beside,
) -> UiResume:
    """Pause this flow run, its gate having refused ``nxt`` on its budget alone, with a :class:`BudgetResume` form
    that starts at the run's budgets and names the estimate; a resume whose budget the estimate still exceeds
    keeps it paused (see :func:`_wait_for_resume`)."""
    run_id = run_dir.name
    est = result.estimate.get("next_stage_cost_usd")
    form = BudgetResume.starting_at(
        f"**The gate after {result.stage} refused {nxt} on its budget.** The estimate of {nxt} is "
        f"${est or 0.0:.6g}; the run's budget.max_run_usd is {_or_unset(spec.budget.max_run_usd)}, its "
        f"budget.max_cost_usd {_or_unset(spec.budget.max_cost_usd)}.\n\n"
        + "".join(f"- {r}\n" for r in decision.reasons)
        + f"\nGive a budget the estimate fits in (or lower stages.{nxt}.max_steps in overrides) and Resume: "
        f"run {run_id} continues with {nxt}. A budget still too low keeps it paused.",
        max_run_usd=spec.budget.max_run_usd,
        max_cost_usd=spec.budget.max_cost_usd,
    )

    def verdict(changed: RunSpec) -> str:
        again = _decide(changed, reestimated(result, changed), run_id, run_dir, beside)
        return "; ".join(again.reasons)

    return _wait_for_resume(
        nxt, spec, run_dir, wait_s, form, decision.summary(), verdict, action=f"after {result.stage}'s gate"
    )


def _or_unset(v: float | None) -> str:
    return f"${v:.6g}" if v is not None else "unset"  # as the gate's lines print dollars


def _resume_hint(spec: RunSpec, run_id: str, nxt: str) -> str:
    """How the terminal starts ``nxt`` of a run its gate refused on budget (resume runs no gate before it)."""
    knob = "budget.max_run_usd" if spec.budget.max_run_usd is not None else "budget.max_cost_usd"
    return f"`traingate resume {run_id} --set {knob}=...` starts {nxt}"


class Beside:
    """What runs beside the ladder: tracking writes kept until the next stage has launched
    (:meth:`after_next_launch`: the identity check, a stage run's identity, a stage's recording, so
    that none shares the flow's process with a stage's start: MLflow's writes are Python, they hold the
    interpreter's lock), and API calls that nothing after them reads (:meth:`thread`); waited for before the run
    ends (:meth:`settle`).

    The kept writes run one after another in one thread, and wait while the ladder has a moment's work of its
    own (:meth:`hold`: from a stage's processes' end to the next launch, at most :data:`HOLD_S`): in the same
    process at once they take as long as in turn, and the one that waits is the ladder's. A short stage
    (a smoke run of a second) leaves the rest to the next one's training."""

    def __init__(self) -> None:
        self.futures: list[PrefectFuture | Future] = []
        self.later: list[Callable[[], list[PrefectFuture | Future]]] = []
        self._context = contextvars.copy_context()  # the flow run's: its task runner, logger and API client
        self._queue: collections.deque[Callable[[], list[PrefectFuture | Future]]] = collections.deque()
        self._turn = threading.Condition()
        self._working = False
        self._held_until = 0.0  # time.monotonic(); the kept writes wait until then
        self._failed: list[BaseException] = []

    def thread(self, call: Callable[..., Any], *args: Any) -> None:
        """``call(*args)`` in a thread of its own with this thread's context (the flow run's logger and API
        client): a Prefect API call or a store's sweep that nothing after it reads."""
        self.futures.append(self.fetch(call, *args))

    @staticmethod
    def fetch(call: Callable[..., T], *args: Any) -> Future[T]:
        """``call(*args)`` in a thread of its own with this thread's context, for a caller that reads its result
        (or its exception) later."""
        future: Future[T] = Future()
        context = contextvars.copy_context()

        def run() -> None:
            try:
                future.set_result(context.run(call, *args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever reads the result
                future.set_exception(e)

        threading.Thread(target=run, name="ladder-beside", daemon=True).start()
        return future

    def after_next_launch(self, submit: Callable[[], list[PrefectFuture | Future]]) -> None:
        self.later.append(submit)

    def launched(self) -> None:
        """Hand what waited for a launch to the writes' thread, and let it go on (a stage's ``launched`` hook;
        also before a pause that may be long)."""
        with self._turn:
            self._held_until = 0.0
            self._queue.extend(self.later)
            self.later.clear()
            if self._queue and not self._working:
                self._working = True
                threading.Thread(target=self._write, name="ladder-beside-writes", daemon=True).start()
            self._turn.notify_all()

    def hold(self) -> None:
        """The ladder has work of its own until the next launch (a stage's ``ended`` hook): the next kept write
        waits for it, at most :data:`HOLD_S` (one in progress finishes)."""
        with self._turn:
            self._held_until = time.monotonic() + HOLD_S

    def _write(self) -> None:
        while True:
            with self._turn:
                while (held := self._held_until - time.monotonic()) > 0:
                    self._turn.wait(held)
                if not self._queue:
                    self._working = False
                    self._turn.notify_all()
                    return
                submit = self._queue.popleft()
            try:
                for f in self._context.copy().run(submit):
                    f.result()
            except BaseException as e:  # noqa: BLE001 - raised by settle, in the flow's thread
                self._failed.append(e)

    def settle(self, writes_only: bool = False) -> None:
        """Submit what waits, then wait for all of it (a failure among them fails the flow, as if awaited inline).
        ``writes_only``: the kept writes; the threads' calls go on (a later settle waits for them)."""
        self.launched()
        with self._turn:
            while self._working:
                self._turn.wait()
        if not writes_only:
            for f in self.futures:
                f.result()
            self.futures.clear()
        if self._failed:
            failed = self._failed[0]
            self._failed.clear()
            raise failed


def _as_is(value: T) -> T:
    """``value`` handed to a task as it is: Prefect walks a task's arguments for futures and states to wait for (a
    spec: 3 ms; a stage's result with a loss series of 400 steps: 15 ms; a walk or two per call), and these hold
    none."""
    return cast(T, quote(value))


def _submitting(task: Any, *args: Any) -> Callable[[], list[PrefectFuture | Future]]:
    """``task`` submitted with ``args`` when called (:meth:`Beside.after_next_launch`)."""
    return lambda: [task.submit(*args)]


def _record(
    stage_run: str, result: StageResult, decision: GateDecision, run_id: str, report: bool
) -> list[PrefectFuture | Future]:
    return [record_stage.submit(stage_run, _as_is(result), _as_is(decision), run_id=run_id, report=report)]


@flow(name="pipeline", log_prints=True)
def pipeline(
    spec_path: str, overrides: list[str] | None = None, until: Stage = "full", commit: str | None = None
) -> State:
    """The ladder from a spec file plus ``--set`` overrides (CI, scripts).

    ``commit``: the commit CI asks to test (the ``ci-canary`` deployment's pull step checks it out);
    refused when the code running here is not that commit, so CI never reports on other code.
    """
    if commit is not None:
        wrong = commit_mismatch(commit, code_version())
        if wrong:
            return stopped(Failed(message=wrong), {})
    return same_end(ladder(load_spec(spec_path, overrides or []), until, return_state=True))


def same_end(state: State) -> State:
    """A flow that wraps another ends as it ended, with its summary as data."""
    if state.is_completed():
        return Completed(message=state.message, data=state.result())
    data = state.result(raise_on_failure=False)
    end: State = Cancelled(message=state.message) if state.is_cancelled() else Failed(message=state.message)
    if isinstance(data, BaseException):  # a RunStopped, or what the wrapped flow raised
        end.data = data
        return end
    return stopped(end, data if isinstance(data, dict) else {})


__all__ = [
    "Approval",
    "checked_here",
    "Resume",
    "RunStopped",
    "ResumeFrom",
    "ResumePoint",
    "flow_settings",
    "ladder",
    "pipeline",
    "same_end",
    "stopped",
    "summary_of",
]
