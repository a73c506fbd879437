"""The rules' inputs read back from a stage's MLflow run: what the runtime logged, as :class:`Signals`.

The runtime logs per-step ``train_loss``, ``grad_norm``, ``step_time_s``, ``data_wait_s`` and
``system/rank<r>/...`` (GPU utilisation only where NVML is present), ``val_*`` at evaluations, and the
tracker tags each restart (``traingate.restart.<n>.time``). Checkpoint times and budgets are not in
the run; the caller adds them (``dataclasses.replace``).
"""

from __future__ import annotations

import calendar
import re
import time

from mlflow.tracking import MlflowClient

from traingate.alerts.rules import Series, Signals

_RANK_STEP = re.compile(r"^system/rank(\d+)/step_time_s$")
_RESTART_TIME = re.compile(r"^traingate\.restart\.(\d+)\.time$")
# One rank: no cross-rank mean is logged, rank 0's own reading is the run's.
_GPU_KEYS = ("system/gpu_util_percent_mean", "system/rank0/gpu_util_percent")


def _by_step(c: MlflowClient, run_id: str, key: str) -> Series:
    return [(m.step, m.value) for m in sorted(c.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))]


def _by_time(c: MlflowClient, run_id: str, key: str) -> Series:
    return [
        (m.timestamp / 1000.0, m.value) for m in sorted(c.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    ]


def from_mlflow(c: MlflowClient, run_id: str, val_metric: str = "val_loss") -> Signals:
    run = c.get_run(run_id)
    keys = set(run.data.metrics)
    get = lambda k: _by_step(c, run_id, k) if k in keys else []  # noqa: E731
    ranks = {int(m.group(1)): _by_step(c, run_id, k) for k in keys if (m := _RANK_STEP.match(k))}
    gpu = next((k for k in _GPU_KEYS if k in keys), None)
    restarts = sorted(
        float(calendar.timegm(time.strptime(v, "%Y-%m-%dT%H:%M:%SZ")))
        for k, v in run.data.tags.items()
        if _RESTART_TIME.match(k)
    )
    beats = (
        [(m.timestamp / 1000.0, float(m.step)) for m in c.get_metric_history(run_id, "train_loss")]
        if "train_loss" in keys
        else []
    )
    return Signals(
        loss=get("train_loss"),
        val=get(val_metric),
        grad_norm=get("grad_norm"),
        step_time=get("step_time_s"),
        data_wait=get("data_wait_s"),
        rank_step_times=ranks if len(ranks) > 1 else {},
        gpu_util=_by_time(c, run_id, gpu) if gpu else [],
        restart_times=restarts,
        heartbeats=sorted(beats),
    )
