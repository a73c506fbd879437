"""Slurm mode: the simulator's passes as a Slurm controller with priority/multifactor and sched/backfill
would make them, so a trace replayed here can be set beside the same jobs on a real Slurm cluster.

The ``multifactor`` order (:func:`traingate.capacity.policy.multifactor_key`) ranks jobs by Slurm's
priority number from the weights of ``simulator.slurm_priority`` in the pools config. Slurm
recomputes fair-share usage and job priorities every ``PriorityCalcPeriod``, not at every event;
:class:`SlurmModePlanner` hands each pass the usage as it stood at the last such recomputation
(``calc_period_s``; 0: the usage of the moment). Backfill is the simulator's EASY backfill on
predictions, which a Slurm job's ``--time`` gives (as a trace's ``est_duration_s``), with Slurm's
caution: Slurm plans backfill on a grid of ``bf_resolution`` seconds (60 by default), so a job that
would end at the head's reserved start, or just before it, counts as overlapping it; here a backfilled
job must end ``bf_resolution_s`` before the head's reservation (``Rules.backfill_margin_s``).

>>> from traingate.capacity.pools import parse_config
>>> cfg = parse_config({"pools": {"p": {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 1.0,
...                                     "worker": "process"}}})
>>> planner_for(Policy.parse("fifo"), cfg) is None, type(planner_for(Policy.parse("multifactor"), cfg)).__name__
(True, 'SlurmModePlanner')
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping

from traingate.capacity.estimate import Predictor
from traingate.capacity.incremental import Queue, Running, plan_pass
from traingate.capacity.jobs import Job
from traingate.capacity.policy import Order, Plan, Policy, Rules
from traingate.capacity.pools import CapacityConfig, PoolConfig, SlurmPriorityConfig

Planner = Callable[..., tuple[Plan, list[Job]]]  # plan_pass's signature


class SlurmModePlanner:
    """A planner (``incremental.plan_pass``'s signature) that runs ``inner`` with the multifactor
    weights and the fair-share usage of the last priority recomputation. One per replay."""

    def __init__(self, weights: SlurmPriorityConfig, inner: Planner = plan_pass) -> None:
        self.weights = weights
        self.inner = inner
        # per pool (its Running): (next recomputation, usage as of the last one)
        self._seen: weakref.WeakKeyDictionary[Running, tuple[float, dict[str, float]]] = weakref.WeakKeyDictionary()

    def __call__(
        self,
        now: float,
        pool: PoolConfig,
        run: Running,
        queue: Queue,
        rules: Rules,
        usage: Mapping[str, float],
        predict: Predictor,
    ) -> tuple[Plan, list[Job]]:
        period = self.weights.calc_period_s
        seen: Mapping[str, float] = usage
        if period > 0:
            last = self._seen.get(run)
            if last is None or now >= last[0]:
                nxt = now + period if last is None else last[0]
                while nxt <= now:
                    nxt += period
                self._seen[run] = (nxt, dict(usage))
            seen = self._seen[run][1]
        rules = dataclasses.replace(rules, slurm_priority=self.weights, backfill_margin_s=self.weights.bf_resolution_s)
        return self.inner(now, pool, run, queue, rules, seen, predict)


def planner_for(policy: Policy, config: CapacityConfig, inner: Planner = plan_pass) -> Planner | None:
    """The planner ``simulate`` needs for ``policy``: Slurm mode for the ``multifactor`` order, else
    None (the simulator's own pass)."""
    if policy.order is Order.MULTIFACTOR:
        return SlurmModePlanner(config.simulator.slurm_priority, inner)
    return None
