"""Offered load of a trace, and the same trace at another load by compressing or stretching its arrivals.

The offered load is the GPU time a trace asks for over the GPU time its pools offer while it
arrives:

    load = sum over jobs of footprint(gpus) x duration_s / (GPUs of the pools it uses x (last - first submission))

(a job's footprint is the GPUs it holds: whole nodes for a job wider than a node). 1.0 means the
jobs ask for exactly what the pools have between the first and the last arrival; above 1 the queue
grows for as long as jobs keep arriving. The generator's ``TraceParams.load`` is the same ratio.

:func:`at_load` rescales the submission times around the first one by ``offered / target``: every
job keeps its size, duration, team, class and estimate, and the arrivals keep their pattern (bursts,
quiet days, recurring jobs' order), only closer together or further apart. That is why traingate
scales time rather than resampling jobs: drawing jobs at random to a new arrival rate would replace
a real trace's bursts with Poisson arrivals and repeat or drop its jobs, so a policy comparison at
1.2x would no longer be a comparison on *that* trace.

>>> from traingate.capacity.pools import parse_config
>>> cfg = parse_config({"pools": {"p": {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 1.0,
...                                     "worker": "process"}}})
>>> trace = [TraceJob(Job("a", "t", "research", "p", 2, 0.0), 100.0),
...          TraceJob(Job("b", "t", "research", "p", 4, 50.0), 50.0),
...          TraceJob(Job("c", "t", "research", "p", 1, 100.0), 200.0)]
>>> offered_load(trace, cfg)   # (2x100 + 4x50 + 1x200) / (4 GPUs x 100 s)
1.5
>>> [tj.job.submit_s for tj in at_load(trace, cfg, 0.75)]   # half the load: arrivals twice as far apart
[0.0, 100.0, 200.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from traingate.capacity.gang import footprint
from traingate.capacity.jobs import Job
from traingate.capacity.pools import CapacityConfig, CapacityError
from traingate.capacity.simulate import TraceJob

LOAD_RANGE = (0.05, 5.0)  # loads at_load accepts: beyond them a trace is all queue or all idle


def offered_load(trace: Sequence[TraceJob], config: CapacityConfig) -> float:
    """GPU-seconds asked / (GPUs of the pools the trace uses x span of its submissions)."""
    if not trace:
        raise CapacityError("the trace has no jobs; its offered load is undefined")
    pools = {p for tj in trace for p in tj.accepts}
    gpus = sum(config.pools[p].capacity for p in pools)
    asked = sum(
        (tj.gpus or footprint(tj.job.slots, config.pools[tj.job.pool].gpus_per_node)) * tj.duration_s for tj in trace
    )
    submits = [tj.job.submit_s for tj in trace]
    span = max(submits) - min(submits)
    if span <= 0:
        raise CapacityError(
            f"all {len(trace)} jobs of the trace arrive at {min(submits):g} s: its offered load is undefined "
            "and cannot be scaled; give the jobs different submit_s"
        )
    return asked / (gpus * span)


def at_load(trace: Sequence[TraceJob], config: CapacityConfig, load: float) -> list[TraceJob]:
    """``trace`` with its submissions compressed or stretched around the first one to offer ``load``."""
    lo, hi = LOAD_RANGE
    if not lo <= load <= hi:
        raise CapacityError(
            f"--load = {load:g}: must be between {lo:g} and {hi:g} (offered GPU time / the pools' GPU time; "
            "0.5-1.5 covers an idle to an overloaded cluster)"
        )
    factor = offered_load(trace, config) / load
    t0 = min(tj.job.submit_s for tj in trace)
    return [dataclasses.replace(tj, job=_moved(tj.job, t0 + (tj.job.submit_s - t0) * factor)) for tj in trace]


def _moved(job: Job, submit_s: float) -> Job:
    return dataclasses.replace(job, submit_s=submit_s)
