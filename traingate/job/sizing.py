"""Sizing and cost: from a measured step-time profile to an estimate of a bigger stage.

>>> est = estimate_stage({"step_time_mean_s": 0.5, "startup_s": 10}, steps=3600, slots=8, price_per_slot_hour=2.5)
>>> round(est["wall_s"]), round(est["cost_usd"], 2)
(1810, 10.06)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from traingate.job.world import stage_world

if TYPE_CHECKING:
    from traingate.spec import RunSpec


def slots(world_size: int) -> int:
    """Billable units of a stage: one per process (a GPU on GPU pools, a core slot on CPU pools)."""
    return world_size


def cost_usd(duration_s: float, n_slots: int, price_per_slot_hour: float) -> float:
    return duration_s / 3600.0 * n_slots * price_per_slot_hour


def estimate_stage(
    profile: Mapping[str, float], steps: int, slots: int, price_per_slot_hour: float, scale_step_time: float = 1.0
) -> dict[str, float]:
    """Wall time and cost of running ``steps`` more steps at the measured pace.

    Uses the mean step time for the total (p99 is for hang timeouts, not totals).
    ``scale_step_time`` lets the caller scale for a different per-step workload.
    """
    per_step = profile.get("step_time_mean_s", 0.0) * scale_step_time
    startup = profile.get("startup_s", 0.0)
    wall = startup + steps * per_step
    return {"wall_s": wall, "cost_usd": cost_usd(wall, slots, price_per_slot_hour), "slot_hours": wall / 3600.0 * slots}


def estimate_of(spec: RunSpec, stage: str, profile: Mapping[str, float]) -> dict[str, float] | None:
    """The estimate of ``stage`` of ``spec`` from a measured profile (a canary's): the stage's steps at the
    profile's pace, on the stage's slots at the pool's price; None without a measured step time.

    The one estimator: the gate before a stage checks budgets with it, and ``traingate run --dry-run`` prints it.
    """
    if not profile.get("step_time_mean_s"):
        return None
    nodes, nproc = stage_world(spec, stage)
    return estimate_stage(
        profile, getattr(spec.stages, stage).max_steps, slots(nodes * nproc), spec.pool.price_per_gpu_hour
    )
