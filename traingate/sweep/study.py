"""The Optuna study behind a sweep: RDB storage with heartbeats, so a dead driver's trials are re-queued.

A trial whose heartbeat stops for ``grace_s`` (its driver died) is failed and re-queued
with the same parameters and the same ``trial_key``; the re-queued trial trains in the
same stage directory and checkpoint location, so it resumes from the last checkpoint.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial

from traingate.spec import RunSpec
from traingate.sweep.algorithms import make_pruner, make_sampler
from traingate.sweep.compat_optuna import trial_system_attrs

MAX_REQUEUES = 3


def study_name(spec: RunSpec) -> str:
    """Stable across re-runs of the same spec, so re-running a dead sweep resumes it."""
    assert spec.sweep is not None
    if spec.sweep.study:
        return spec.sweep.study
    return f"{spec.identity.experiment}-sweep-{spec.spec_hash()[:8]}"


def trial_key(trial: optuna.Trial | FrozenTrial) -> str:
    """Names a trial's stage dir and checkpoints; a re-queued trial keeps its original's key."""
    return trial.user_attrs.get("trial_key") or f"trial-{trial.number:04d}"


def requeue_of(trial: optuna.Trial) -> int | None:
    """The number of the stale trial this one re-runs (None for a fresh trial)."""
    attrs = trial_system_attrs(trial)
    return attrs.get("failed_trial")  # what RetryHeartbeatStaleTrialCallback records


class _Requeue(RetryHeartbeatStaleTrialCallback):
    def __init__(self, on_stale: Callable[[FrozenTrial], None] | None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            super().__init__(max_retry=MAX_REQUEUES)
        self.on_stale = on_stale

    def __call__(self, study: optuna.study.Study, trial: FrozenTrial) -> None:
        if self.on_stale is not None:
            self.on_stale(trial)  # e.g. give back the dead holder's concurrency slots
        super().__call__(study, trial)


def _storage(
    url: str, heartbeat_s: float, grace_s: float, on_stale: Callable[[FrozenTrial], None] | None
) -> optuna.storages.RDBStorage:
    with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna since 2.8; we rely on them
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _rdb(url, heartbeat_s, grace_s, on_stale)


def _rdb(
    url: str, heartbeat_s: float, grace_s: float, on_stale: Callable[[FrozenTrial], None] | None
) -> optuna.storages.RDBStorage:
    return optuna.storages.RDBStorage(
        url,
        heartbeat_interval=max(1, math.ceil(heartbeat_s)),
        grace_period=max(1, math.ceil(grace_s)),
        heartbeat_stale_trial_callback=_Requeue(on_stale),
        engine_kwargs={"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None,
    )


def open_study(
    spec: RunSpec, storage_url: str, on_stale: Callable[[FrozenTrial], None] | None = None, reporting_only: bool = False
) -> optuna.Study:
    """The sweep's study. ``reporting_only``: for a trial's runner, which reports and asks the pruner but
    never samples (so it gets a plain sampler: re-sampling a relative search space there would be wasted
    work, and CMA-ES would record its generation twice)."""
    sw = spec.sweep
    assert sw is not None
    storage = _storage(storage_url, sw.heartbeat_s, sw.grace_s, on_stale)
    max_steps = getattr(spec.stages, sw.stage).max_steps
    study = optuna.create_study(
        study_name=study_name(spec),
        storage=storage,
        load_if_exists=True,
        directions=sw.directions,
        sampler=optuna.samplers.RandomSampler() if reporting_only else make_sampler(sw),
        pruner=make_pruner(sw, max_steps),
    )
    # The study remembers what it was created for; a different objective under the same name is a mistake.
    fp = hashlib.sha256(repr((sw.directions, [o.metric for o in sw.objectives])).encode()).hexdigest()[:12]
    if study.user_attrs.get("objective_fingerprint", fp) != fp:
        raise ValueError(f"study {study.study_name!r} exists with other objectives; set sweep.study to a new name")
    study.set_user_attr("objective_fingerprint", fp)
    return study
