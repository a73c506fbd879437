"""A sweep: trials as concurrency-limited subflows, ask-and-tell against Optuna RDB storage.

    open study + limits -> [trial subflows, <= max_concurrent at once] -> re-run top-K -> report -> (promote)

Re-running the same spec resumes the sweep: finished trials are kept, trials of a dead
driver are re-queued and resume from their checkpoints.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import optuna
from prefect import flow, get_client, get_run_logger
from prefect.states import Completed, Failed, State

from flows.pipeline import flow_settings, ladder, same_end
from tasks import slots
from tasks.sweep import (
    ensure_concurrency_limit,
    limit_name,
    open_sweep_run,
    open_trial_run,
    publish_sweep,
    record_trial,
    release_leases,
    run_trial_stage,
)
from traingate.job.vocab import Status
from traingate.job.world import stage_world
from traingate.ladder.sweep_preflight import check_sweep
from traingate.settings import LocationError
from traingate.snapshots import resolve_spec
from traingate.spec import RunSpec, load_spec
from traingate.sweep import compat_optuna
from traingate.sweep.driver import drive
from traingate.sweep.report import TrialOutcome
from traingate.sweep.results import Reproduction, ranked, reproducibility, sweep_seeds
from traingate.sweep.space import trial_spec, write_spec
from traingate.sweep.study import open_study, requeue_of


@flow(name="sweep-trial")
def sweep_trial(
    spec: RunSpec,
    storage_url: str,
    params: dict[str, Any],
    parent_run_id: str,
    limits: list[tuple[str, int]],
    trial_id: int | None = None,
    trial_number: int | None = None,
    requeue_of: int | None = None,
    seed: int | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """One trial: its MLflow child run, its training stage, its outcome."""
    sw = spec.sweep
    assert sw is not None
    label = f"trial-{trial_number}" if seed is None else f"trial-{trial_number}-seed-{seed}"
    tags = {"traingate.trial_number": str(trial_number)}
    if requeue_of is not None:
        tags["traingate.requeue_of_trial"] = str(requeue_of)
    if seed is not None:
        tags["traingate.reproduction_seed"] = str(seed)
    run_id = open_trial_run(parent_run_id, label, params, tags)
    outcome = run_trial_stage(spec, trial_spec(spec, params, seed), storage_url, trial_id, key, run_id, limits)
    record_trial(run_id, outcome, sw.objectives[0].metric)
    return outcome


def _in_threads(ctx: contextvars.Context):
    """Calls a subflow from a worker thread as a child of the current flow run."""

    def call(fn, *args: Any, **kwargs: Any) -> Any:
        return ctx.copy().run(fn, *args, **kwargs)

    return call


def _reproduce(
    spec: RunSpec, storage_url: str, study: optuna.Study, parent: str, limits: list[tuple[str, int]], call
) -> list[Reproduction]:
    sw = spec.sweep
    assert sw is not None
    reps = [Reproduction(t.number, t.params, t.values[0]) for t in ranked(study, sw)[: sw.promotion.top_k]]
    jobs = [(r, s) for r in reps for s in sweep_seeds(spec.optim.seed, sw.promotion.seeds)]
    with ThreadPoolExecutor(sw.max_concurrent, thread_name_prefix="rerun") as pool:
        futs = [
            (
                r,
                pool.submit(
                    call,
                    sweep_trial,
                    spec,
                    storage_url,
                    r.params,
                    parent,
                    limits,
                    trial_number=r.trial_number,
                    seed=s,
                    key=f"rerun-{r.trial_number:04d}-seed-{s}",
                ),
            )
            for r, s in jobs
        ]
        for r, f in futs:
            out = f.result()
            if out["state"] == Status.COMPLETED:
                r.rerun_values.append(out["values"][0])
    return reps


@flow(name="sweep", log_prints=True)
def sweep(spec: RunSpec, promote: bool = False) -> State:
    """Run, or resume, the hyperparameter sweep of ``spec`` (its ``sweep:`` section)."""
    log = get_run_logger()
    spec = resolve_spec(spec)  # data.uri's {latest}: every trial trains on the version resolved now
    sw = check_sweep(spec)
    try:  # from a deployment: the pool's locations and credentials
        settings = flow_settings().ensure()
    except LocationError as e:
        return Failed(message=str(e))
    storage = settings.optuna_storage
    study = open_study(spec, storage, on_stale=release_leases)
    out_dir = settings.state_dir / "sweeps" / study.study_name
    limits = [(limit_name(study.study_name), 1)]
    ensure_concurrency_limit(limits[0][0], sw.max_concurrent)
    if sw.pool_limit and _pool_scheduled(spec):
        # The server schedules the pool (`traingate pools bootstrap`): every trial already waits for
        # its gang slots in the launch task; taking the pool's limit here too would count them twice.
        log.info(
            "sweep.pool_limit %s: the pool is scheduled by the server's capacity config; trials take "
            "their gang slots in the pool's queue",
            sw.pool_limit,
        )
    elif sw.pool_limit:  # the work pool's slots: must exist already (created with the pool), strict
        nodes, nproc = stage_world(spec, sw.stage)
        limits.append((sw.pool_limit, nodes * nproc))
    parent = open_sweep_run(spec, storage)
    call = _in_threads(contextvars.copy_context())

    def run_trial(trial: optuna.Trial, params: dict[str, Any]) -> TrialOutcome:
        out = call(
            sweep_trial,
            spec,
            storage,
            params,
            parent,
            limits,
            trial_id=compat_optuna.trial_id(trial),
            trial_number=trial.number,
            requeue_of=requeue_of(trial),
        )
        return TrialOutcome(**{k: v for k, v in out.items() if k != "intermediate"})

    result = drive(study, sw, run_trial)
    log.info("sweep %s: %s", study.study_name, result.stop_reason)
    best = ranked(study, sw)
    summary: dict[str, Any] = {
        "study": study.study_name,
        "stop_reason": result.stop_reason,
        "trials_finished": len(result.finished),
        "total_steps": result.steps,
        "cost_usd": result.cost_usd,
        "storage": storage,
        "parent_run_id": parent,
        "sweep_dir": str(out_dir),
    }
    # The driver starts no trial once the trials' recorded cost reaches the sweep's budget; the end says so.
    spent = sw.budget.max_cost_usd is not None and result.cost_usd >= sw.budget.max_cost_usd
    budget_note = (
        f"; budget spent: the trials cost ${result.cost_usd:.6g} of sweep.budget.max_cost_usd "
        f"${sw.budget.max_cost_usd:.6g}, no further trial was started"
        if spent
        else ""
    )
    summary["budget_spent"] = spent
    if not best:
        publish_sweep(spec, storage, parent, summary, [], str(out_dir))
        return Failed(message=f"sweep {study.study_name}: no trial completed{budget_note}", data=summary)
    winner, verdict = best[0], None
    if sw.promotion.top_k:
        verdict = reproducibility(_reproduce(spec, storage, study, parent, limits, call), sw)
        winner = next(t for t in best if t.number == verdict.winner)
        summary.update(reproducible=str(verdict.passed), reproducibility=" ".join(verdict.reasons) or "ok")
    best_path = write_spec(
        trial_spec(spec, winner.params),
        out_dir / "best_spec.yaml",
        f"best of sweep {study.study_name}: trial {winner.number}, "
        f"{sw.objectives[0].metric} = {winner.values[0]:.6g}\nrun it: traingate run THIS_FILE",
    )
    summary.update(
        best_trial=winner.number, best_value=winner.values[0], best_spec=str(best_path), best_params=str(winner.params)
    )
    summary["plots"] = publish_sweep(spec, storage, parent, summary, [str(best_path)], str(out_dir))
    if promote:
        if verdict is not None and sw.promotion.require_reproducible and not verdict.passed:
            return Failed(message="promotion refused: " + "; ".join(verdict.reasons), data=summary)
        state = ladder(load_spec(best_path), sw.promotion.until, return_state=True)
        summary["promoted"] = state.is_completed()
        summary["promotion"] = state.message
        if not state.is_completed():
            return Failed(message=f"promoted best spec stopped: {state.message}", data=summary)
    return Completed(
        message=f"sweep {study.study_name}: best trial {winner.number} "
        f"{sw.objectives[0].metric}={winner.values[0]:.4g}{budget_note}",
        data=summary,
    )


@flow(name="sweep-file", log_prints=True)
def sweep_file(spec_path: str, overrides: list[str] | None = None, promote: bool = False) -> State:
    """The sweep from a spec file plus ``--set`` overrides (CI, scripts)."""
    return same_end(sweep(load_spec(spec_path, overrides or []), promote, return_state=True))


def _pool_scheduled(spec: RunSpec) -> bool:
    with get_client(sync_client=True) as c:
        cfg = slots.read_config(c)
    return cfg is not None and spec.resources.work_pool in cfg.pools
