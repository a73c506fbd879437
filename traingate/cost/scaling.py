"""Scaling advice: does a stage get enough faster with more processes to be worth what they cost?

From two measured profiles of the same stage -- one at 1 process, one at N (the ``profile``
metrics a stage's result holds: ``samples_per_s`` is the whole world's throughput) -- the scaling
efficiency is ``throughput_N / (N x throughput_1)``. Every process is one slot at the pool's price,
so a sample at N costs ``1 / efficiency`` times what it costs at 1: N processes buy time with
money, and they stop paying off when too little of the extra money turns into speed. The
threshold is the caller's (``min_efficiency``, default 0.75: a sample may cost up to a third more).

>>> a = advise({"samples_per_s": 100.0}, {"samples_per_s": 360.0}, 4, price_per_slot_hour=2.5)
>>> round(a.efficiency, 2), round(a.speedup, 2), a.pays_off
(0.9, 3.6, True)
>>> print(a.sentence)  # doctest: +NORMALIZE_WHITESPACE
4 processes: 3.60x the throughput of 1 (scaling efficiency 90%); a sample costs 1.11x as much
($7.7160 vs $6.9444 per 1M samples at $2.50 per slot-hour): adding processes still pays off
(efficiency >= 75%).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from traingate.cost.ledger import Run


@dataclass(frozen=True)
class Scaling:
    processes: int
    samples_per_s_1: float
    samples_per_s_n: float
    price_per_slot_hour: float
    min_efficiency: float

    @property
    def speedup(self) -> float:
        return self.samples_per_s_n / self.samples_per_s_1

    @property
    def efficiency(self) -> float:
        return self.samples_per_s_n / (self.processes * self.samples_per_s_1)

    def usd_per_million_samples(self, processes: int) -> float:
        sps = self.samples_per_s_1 if processes == 1 else self.samples_per_s_n
        return processes * self.price_per_slot_hour / 3600.0 / sps * 1e6

    @property
    def pays_off(self) -> bool:
        return self.speedup > 1.0 and self.efficiency >= self.min_efficiency

    @property
    def sentence(self) -> str:
        n = self.processes
        head = (
            f"{n} processes: {self.speedup:.2f}x the throughput of 1 (scaling efficiency "
            f"{100 * self.efficiency:.0f}%); a sample costs {1 / self.efficiency:.2f}x as much "
            f"(${self.usd_per_million_samples(n):.4f} vs ${self.usd_per_million_samples(1):.4f} per 1M samples "
            f"at ${self.price_per_slot_hour:.2f} per slot-hour): "
        )
        if self.pays_off:
            return head + f"adding processes still pays off (efficiency >= {100 * self.min_efficiency:.0f}%)."
        if self.speedup <= 1.0:
            return head + f"{n} processes are no faster than 1; run on 1 until the scaling bottleneck is fixed."
        return head + (
            f"adding processes stops paying off (efficiency < {100 * self.min_efficiency:.0f}%); "
            f"use fewer, unless finishing sooner is worth the extra cost."
        )


def advise(
    profile_1: Mapping[str, float],
    profile_n: Mapping[str, float],
    processes: int,
    price_per_slot_hour: float,
    min_efficiency: float = 0.75,
) -> Scaling:
    """Scaling from a profile at 1 process and one at ``processes``; ValueError naming what is missing."""
    if processes < 2:
        raise ValueError(f"processes = {processes}: scaling compares 1 process with 2 or more")
    if not 0 < min_efficiency <= 1:
        raise ValueError(f"min_efficiency = {min_efficiency}: needs 0 < value <= 1, e.g. 0.75")
    if not (math.isfinite(price_per_slot_hour) and price_per_slot_hour >= 0):
        raise ValueError(f"price_per_slot_hour = {price_per_slot_hour}: needs a finite value >= 0")
    rates = []
    for name, p in (("1 process", profile_1), (f"{processes} processes", profile_n)):
        sps = p.get("samples_per_s")
        if not isinstance(sps, (int, float)) or not math.isfinite(sps) or sps <= 0:
            raise ValueError(
                f"profile at {name}: samples_per_s = {sps!r}; needs a measured throughput > 0 "
                "(a stage that completed steps)"
            )
        rates.append(float(sps))
    return Scaling(processes, rates[0], rates[1], price_per_slot_hour, min_efficiency)


def by_family(runs: Iterable[Run], min_efficiency: float = 0.75) -> dict[str, tuple[str, Scaling]]:
    """Experiment -> (run id, advice) from the first run (newest first, as gathered) that measured a profile
    at 1 process and at more (a ladder's smoke runs 1 process, its canary a node's worth)."""
    out: dict[str, tuple[str, Scaling]] = {}
    for r in runs:
        wider = [n for n in r.profiles if n > 1]
        if r.experiment in out or 1 not in r.profiles or not wider:
            continue
        n = max(wider)
        out[r.experiment] = (r.run_id, advise(r.profiles[1], r.profiles[n], n, r.price_per_slot_hour, min_efficiency))
    return dict(sorted(out.items()))
