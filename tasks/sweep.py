"""Sweep boundaries: concurrency slots on the Prefect server, one trial's process tree, MLflow, plots.

Each task wraps one side effect. The search itself (ask/tell, budgets, re-queueing) is
``traingate.sweep.driver``; the flow in ``flows/sweep.py`` wires the two together.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client

from tasks.compat_prefect import (
    acquire_concurrency_slots_with_lease,
    maintain_concurrency_lease,
    release_concurrency_slots_with_lease,
)
from tasks.tracking import request_key
from tasks.train import run_stage_job
from traingate.job.files import ProgressFollower
from traingate.job.stagejob import JobKind, derive
from traingate.job.vocab import Status
from traingate.settings import Settings
from traingate.spec import RunSpec
from traingate.sweep import tracking as sweep_tracking
from traingate.sweep.fence import fence
from traingate.sweep.plots import save_plots
from traingate.sweep.report import Reporter, TrialOutcome, objective_values
from traingate.sweep.study import open_study, trial_key
from traingate.tracking import runs

_MLFLOW: dict[str, Any] = dict(cache_policy=NONE, retries=3, retry_delay_seconds=[1, 5, 15])
LEASE_S = 300.0  # Prefect renews the lease while a trial runs; a dead holder's slots come back after this


def limit_name(study_name: str) -> str:
    return "sweep-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", study_name)


@task(name="ensure-concurrency-limit", cache_policy=NONE, retries=2, retry_delay_seconds=2)
def ensure_concurrency_limit(name: str, limit: int) -> None:
    """Create the global concurrency limit, or set its size (idempotent: safe on every sweep start)."""
    with get_client(sync_client=True) as c:
        c.upsert_global_concurrency_limit_by_name(name, limit)


def release_leases(trial: FrozenTrial) -> None:
    """Give back the slots a dead driver's trial held (called when Optuna finds the trial stale)."""

    for lease in trial.user_attrs.get("prefect_leases", []):
        # A lease that already expired is gone on the server; releasing it does nothing (tests/test_compat.py).
        release_concurrency_slots_with_lease(lease)


@contextlib.contextmanager
def trial_slots(limits: list[tuple[str, int]], on_leases: Callable[[list[str]], None]) -> Iterator[None]:
    """Hold ``occupy`` slots of each named limit (strict: a missing limit is an error, not a no-op).

    Like ``prefect.concurrency.sync.concurrency``, but the lease ids are handed to
    ``on_leases`` (stored on the Optuna trial), so whoever re-queues a dead trial can release
    its slots at once instead of waiting for the lease to expire.
    """
    # Private Prefect API, confined to tasks/compat_prefect.py: the public context manager hides the lease id.

    with contextlib.ExitStack() as stack:
        leases: list[str] = []
        for name, occupy in limits:  # always in the same order: no two trials wait on each other's half
            resp = acquire_concurrency_slots_with_lease([name], occupy, lease_duration=LEASE_S, strict=True)
            leases.append(str(resp.lease_id))
            stack.callback(release_concurrency_slots_with_lease, resp.lease_id)
            stack.enter_context(
                maintain_concurrency_lease(resp.lease_id, LEASE_S, raise_on_lease_renewal_failure=False)
            )
        on_leases(leases)
        yield


def trial_dir(settings: Settings, study_name: str, key: str) -> Path:
    return settings.state_dir / "sweeps" / study_name / key


class _Pruner:
    """The trial's watcher: feeds the trainer's progress to Optuna; a reason to stop once it prunes."""

    def __init__(self, reporter: Reporter | None, stage_dir: Path):
        self.reporter, self.follower = reporter, ProgressFollower(stage_dir)

    def tick(self) -> str | None:
        prune = False
        for rec in self.follower.new():
            prune = (self.reporter is not None and self.reporter.feed(rec)) or prune
        return f"pruned at step {self.reporter.pruned_at}" if prune and self.reporter is not None else None


@task(name="sweep-trial-stage", cache_policy=NONE, retries=0)
def run_trial_stage(
    spec: RunSpec,
    trial_spec: RunSpec,
    storage_url: str,
    trial_id: int | None,
    key: str | None,
    mlflow_run_id: str | None,
    limits: list[tuple[str, int]],
) -> dict[str, Any]:
    """Train one trial's stage through the launch task (supervised: a lost worker restarts from the
    trial's checkpoint); report validation to Optuna while it runs; stop it when pruned.

    ``trial_id`` None: a re-run outside the study (reproducibility check), named by ``key``, never pruned.
    """
    log = get_run_logger()
    sw = spec.sweep
    assert sw is not None
    settings = Settings.from_env()
    study = open_study(spec, storage_url, reporting_only=True)
    trial = optuna.trial.Trial(study, trial_id) if trial_id is not None else None
    key = trial_key(trial) if trial is not None else key
    assert key, "a re-run needs a key"
    number = trial.number if trial is not None else -1
    out = trial_dir(settings, study.study_name, key)
    job = derive(
        trial_spec,
        sw.stage,
        run_id=f"{study.study_name}-{key}",
        run_dir=out.parent,
        stage_dir=out,
        settings=settings,
        mlflow_run_id=mlflow_run_id,
        kind=JobKind.TRIAL,
        eval_every=sw.scheduler.report_every,
    )
    pruner = _Pruner(Reporter(trial, sw) if trial is not None else None, out)

    def on_leases(ids: list[str]) -> None:
        if trial is not None:
            trial.set_user_attr("prefect_leases", ids)

    with trial_slots(limits, on_leases):
        start = time.time()
        out.mkdir(parents=True, exist_ok=True)
        fenced = fence(out)
        if fenced:
            log.warning("trial %d: stopped orphaned trainer(s) %s of a previous attempt", number, fenced)
        # A re-queued trial continues from its own checkpoint: the launch task finds it there.
        result = run_stage_job(job, watcher=pruner)
        end = time.time()
    if result.status != Status.PREEMPTED:
        pruner.tick()  # the last reports; a finished trial is not pruned after the fact
    steps = int(result.metrics.get("steps", 0))
    metrics = dict(result.numeric_metrics())
    metrics.update(cost_usd=result.cost_usd, duration_s=result.duration_s, steps=float(steps))
    oc = TrialOutcome(
        state=Status.FAILED,
        steps=steps,
        cost_usd=result.cost_usd,
        start_ts=start,
        end_ts=end,
        pid=result.details.get("pid"),
        metrics=metrics,
        resumed_from_step=int(result.metrics.get("resumed_from_step") or 0),
        restarts=int(result.metrics.get("restarts", 0)),
    )
    reporter = pruner.reporter
    if reporter is not None and reporter.pruned_at is not None and result.status == Status.PREEMPTED:
        oc.state, oc.pruned_at_step = Status.PRUNED, reporter.pruned_at
    elif result.status == Status.COMPLETED:
        try:
            oc.values, oc.state = objective_values(sw, metrics), Status.COMPLETED
        except ValueError as e:
            oc.error = str(e)
    else:
        oc.error = result.error or str(result.status)
    d = oc.to_dict()
    d["intermediate"] = reporter.history if reporter is not None else []
    return d


@task(name="open-sweep-run", **_MLFLOW)
def open_sweep_run(spec: RunSpec, storage_url: str) -> str:
    s = Settings.from_env()
    return sweep_tracking.open_sweep_run(
        runs.client(s.tracking_uri),
        spec,
        open_study(spec, storage_url),
        s.artifact_uri,
        request_key=request_key("sweep"),
    )


@task(name="open-trial-run", **_MLFLOW)
def open_trial_run(parent_run_id: str, label: str, params: dict[str, Any], tags: dict[str, str]) -> str:
    c = runs.client(Settings.from_env().tracking_uri)
    return sweep_tracking.open_trial_run(c, parent_run_id, label, params, tags, request_key=request_key("trial"))


@task(name="record-trial", **_MLFLOW)
def record_trial(run_id: str, outcome: dict[str, Any], metric: str) -> None:
    oc = TrialOutcome(**{k: v for k, v in outcome.items() if k != "intermediate"})
    c = runs.client(Settings.from_env().tracking_uri)
    sweep_tracking.record_trial(c, run_id, oc, [tuple(x) for x in outcome.get("intermediate", [])], metric)


@task(name="sweep-report", cache_policy=NONE)
def publish_sweep(
    spec: RunSpec, storage_url: str, parent_run_id: str, summary: dict[str, Any], files: list[str], out_dir: str
) -> list[str]:
    """Plots of the study, the summary as a Prefect artifact, everything onto the MLflow parent run."""
    study = open_study(spec, storage_url)
    assert spec.sweep is not None  # the sweep flow checked its section before any trial
    plots = save_plots(study, Path(out_dir) / "plots", [o.metric for o in spec.sweep.objectives])
    c = runs.client(Settings.from_env().tracking_uri)
    sweep_tracking.close_sweep_run(c, parent_run_id, summary, [*plots, *map(Path, files)])
    lines = [
        f"# Sweep `{study.study_name}`",
        "",
        f"stopped: {summary.get('stop_reason')}",
        "",
        "| key | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in summary.items()],
        "",
        "Plots (MLflow artifacts of the parent run, folder `sweep/`): " + ", ".join(p.name for p in plots),
    ]
    create_markdown_artifact(
        "\n".join(lines),
        key=re.sub(r"[^a-z0-9-]+", "-", limit_name(study.study_name).lower()),
        description="sweep summary",
    )
    return [str(p) for p in plots]
