"""Fair share: a team's recent GPU-hours, exponentially decayed, lower its place in its class.

A GPU busy for a team at time ``s`` counts ``2 ** (-(now - s) / H)`` of a GPU-second at ``now``:
work done one half-life ``H`` ago weighs half, two half-lives ago a quarter. A team's usage is

    U(now) = (1 / 3600) * sum over its jobs k of  g_k * integral over [a_k, min(b_k, now)] of 2 ** (-(now - s) / H) ds

in GPU-hours, for a job holding ``g_k`` GPUs from ``a_k`` to ``b_k``. Each interval has the closed form

    g * (H / ln 2) * (2 ** (-(now - b) / H) - 2 ** (-(now - a) / H)) / 3600

and between events, with the team holding ``g`` GPUs throughout a step of ``dt`` seconds,

    U(t + dt) = U(t) * d + g * (H / ln 2) * (1 - d) / 3600,    d = 2 ** (-dt / H).

Among waiting jobs of the same priority class, the team with the smaller ``U`` goes first
(then submission order). A team that has run nothing for a few half-lives is back to ~0.

>>> H = 3600.0                                     # a one-hour half-life
>>> round(decayed_usage([("a", 8, 0.0, 3600.0)], now=3600.0, half_life_s=H)["a"], 4)
5.7708
>>> round(decayed_usage([("a", 8, 0.0, 3600.0)], now=7200.0, half_life_s=H)["a"], 4)   # an hour later: half
2.8854
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

LN2 = math.log(2.0)


def decayed_usage(
    intervals: Iterable[tuple[str, int, float, float | None]], now: float, half_life_s: float
) -> dict[str, float]:
    """Decayed GPU-hours per team at ``now`` from ``(team, gpus, start_s, end_s)`` intervals
    (``end_s`` None for a job still running). Intervals after ``now`` count up to ``now``."""
    out: dict[str, float] = {}
    scale = half_life_s / LN2 / 3600.0
    for team, gpus, a, b in intervals:
        b = now if b is None or b > now else b
        if b <= a:
            out.setdefault(team, 0.0)
            continue
        w = gpus * scale * (2.0 ** (-(now - b) / half_life_s) - 2.0 ** (-(now - a) / half_life_s))
        out[team] = out.get(team, 0.0) + w
    return out


def advance(
    usage: Mapping[str, float], gpus_held: Mapping[str, float], dt_s: float, half_life_s: float
) -> dict[str, float]:
    """Usage ``dt_s`` seconds later, each team having held ``gpus_held[team]`` GPUs throughout."""
    out = dict(usage)
    advance_in_place(out, gpus_held, *decay_step(dt_s, half_life_s))
    return out


def decay_step(dt_s: float, half_life_s: float) -> tuple[float, float]:
    """(decay, gain) of ``dt_s`` seconds: usage is multiplied by the decay, each GPU held adds the gain."""
    d = 2.0 ** (-dt_s / half_life_s)
    return d, half_life_s / LN2 * (1.0 - d) / 3600.0


def advance_in_place(usage: dict[str, float], gpus_held: Mapping[str, float], decay: float, gain: float) -> None:
    """:func:`advance` on ``usage`` itself, with one :func:`decay_step` (a replay steps many pools by one)."""
    for team in usage:
        usage[team] *= decay
    for team, g in gpus_held.items():
        usage[team] = usage.get(team, 0.0) + g * gain
