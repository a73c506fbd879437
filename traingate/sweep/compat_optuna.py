"""Optuna's private API: the only place traingate reaches past Optuna's public surface.

Written against ``optuna==5.0.0`` (the pin in pyproject.toml); ``tests/test_compat.py`` fails
when the installed version or the behaviour relied on here changes, so a version bump is
re-checked here and nowhere else.

Why at all: a sweep's trials run in Prefect subflows that rebuild an ``optuna.Trial`` from its
storage id, and the heartbeat and re-queue bookkeeping lives on the storage, which a ``Study``
does not expose.
"""

from __future__ import annotations

from typing import Any

import optuna

PINNED = "5.0.0"


def trial_id(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
    """The trial's id in its storage (unique across studies; ``trial.number`` is per study).

    ``optuna.trial.Trial(study, trial_id)`` rebuilds a live trial from it in another process.
    """
    return trial._trial_id  # noqa: SLF001


def storage(study: optuna.Study) -> optuna.storages.BaseStorage:
    """The study's storage: where ``record_heartbeat`` and trial system attributes live."""
    return study._storage  # noqa: SLF001


def trial_system_attrs(trial: optuna.Trial) -> dict[str, Any]:
    """The system attributes of a live trial, read from its storage.

    ``RetryHeartbeatStaleTrialCallback`` records ``failed_trial`` (the number of the stale trial a
    re-queued one re-runs) there; ``Trial`` has no public reader for system attributes.
    """
    return storage(trial.study).get_trial_system_attrs(trial_id(trial))
