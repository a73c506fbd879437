"""The default loss-spike rule on curves with per-step noise: silent on clean curves of many seeds, a
sustained 3x jump caught within 10 steps (mostly at its own step). (A recipe whose per-step loss itself swings 3x - the digits
example late in training - is beyond any per-step rule without false alarms: docs/monitoring.md.)"""

from __future__ import annotations

import math
import random

import pytest

from traingate.alerts.rules import LossSpikeSpec, loss_spike


def _curve(seed: int, steps: int = 400, noise: float = 0.15) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    return [(s, (0.2 + 2.0 / math.sqrt(s)) * math.exp(rng.gauss(0.0, noise))) for s in range(1, steps + 1)]


@pytest.mark.parametrize("seed", range(20))
def test_a_clean_noisy_curve_raises_nothing(seed):
    assert loss_spike(_curve(seed), LossSpikeSpec()) is None


@pytest.mark.parametrize("seed, at", [(s, at) for s in range(5) for at in (60, 150, 300)])
def test_a_sustained_3x_jump_is_caught_within_10_steps(seed, at):
    spiked = [(s, v * 3 if s >= at else v) for s, v in _curve(seed)]
    firing = loss_spike(spiked, LossSpikeSpec())
    assert firing is not None and at <= firing.at < at + 10, firing
