"""The default loss-spike rule on noisy curves: silent on clean curves of many seeds and on a slow drift,
a sustained 3x jump caught within 10 steps, one noisy batch ignored; the training process's per-step guard
decides exactly as the rule does. (Measured on recorded runs of the digits demo and char-gpt by
``python -m bench spike``: docs/benchmarks.md.)"""

from __future__ import annotations

import math
import random

import pytest

from traingate.alerts.rules import AlertsSpec, LossSpikeSpec, loss_spike
from traingate.runtime.spike_guard import SpikeGuard

SPEC = LossSpikeSpec()


def _curve(seed: int, steps: int = 400, noise: float = 0.25) -> list[tuple[int, float]]:
    """A loss falling from 2.3 to 0.1, as a 10-class classifier's does, with per-step log-normal noise of a
    small batch (one step in twenty 1.6x above its trend). At this noise 1 seed in 100 fires (seed 62):
    the rule is tuned on recorded runs, whose noise is less heavy-tailed than this."""
    rng = random.Random(seed)
    return [(s, (0.1 + 2.2 * math.exp(-s / 30)) * math.exp(rng.gauss(0.0, noise))) for s in range(1, steps + 1)]


@pytest.mark.parametrize("seed", range(20))
def test_a_clean_noisy_curve_raises_nothing(seed):
    assert loss_spike(_curve(seed), SPEC) is None


def test_a_sustained_3x_jump_is_caught_within_10_steps_in_most_placements_and_dated_at_its_start():
    # Per-step noise can pull a 3x jump's median below 2x the baseline: the rule trades those for silence on
    # clean runs. On this curve: 88 of 100 placements between steps 30 and 90 (python -m bench spike measures
    # the recorded runs).
    caught = 0
    for seed in range(20):
        for at in (30, 45, 60, 75, 90):
            firing = loss_spike([(s, v * 3 if s >= at else v) for s, v in _curve(seed)], SPEC)
            assert firing is None or firing.at >= at, firing  # nothing before the jump
            caught += firing is not None and at <= firing.at <= firing.values["decided_at"] < at + 10
    assert caught >= 85, caught


def test_a_3x_jump_over_little_noise_is_caught_at_its_start_and_decided_4_steps_later():
    curve = [(s, 4.2 * math.exp(-s / 60) + 1.4) for s in range(1, 200)]  # a char-level model's smooth fall
    firing = loss_spike([(s, v * 3 if s >= 120 else v) for s, v in curve], SPEC)
    assert (firing.at, firing.values["decided_at"]) == (120, 123)  # 4 of the 6 latest points are up


def test_one_batch_at_5x_is_not_a_spike():
    curve = _curve(0)
    assert loss_spike([(s, v * 5 if s == 200 else v) for s, v in curve], SPEC) is None


def test_a_slow_drift_up_is_not_a_spike():
    # The loss rises 2.25x over 250 steps (a bad LR schedule, overfitting): the stagnation rule's business.
    drift = [(s, v * (1 + max(0, s - 150) / 200)) for s, v in _curve(1)]
    assert loss_spike(drift, SPEC) is None


def test_a_3x_wiggle_near_zero_loss_is_not_a_spike_but_the_same_jump_early_is():
    # Fallen from 2.3 to 0.01, a rise to 0.03 gives back 1% of the fall: noise on small batches, no roll-back.
    late = [(s, 2.3) for s in range(1, 11)] + [(s, 0.01) for s in range(11, 60)]
    assert loss_spike(late + [(s, 0.03) for s in range(60, 70)], SPEC) is None
    mid = [(s, 2.3) for s in range(1, 11)] + [(s, 0.5) for s in range(11, 60)]
    assert loss_spike(mid + [(s, 1.5) for s in range(60, 70)], SPEC).at == 60


def test_the_training_process_guard_decides_at_the_same_step_as_the_rule():
    spiked = [(s, v * 3 if s >= 150 else v) for s, v in _curve(3)]
    firing = loss_spike(spiked, SPEC)
    pinned: list[int] = []
    guard = SpikeGuard(AlertsSpec(), lambda step: pinned.append(step) or None, lambda: None, lambda: True)
    decided = next(s for s, v in spiked if guard.observe(s, v))
    assert (pinned, decided) == ([firing.at], firing.values["decided_at"])


def test_the_guard_seeded_after_a_relaunch_keeps_the_start_level():
    from traingate.job.files import StepMetrics

    curve = _curve(4)
    earlier = [StepMetrics(s, 0.0, v, 1.0, 0.001, 0.01, 0.0, 0) for s, v in curve[:200]]
    guard = SpikeGuard(AlertsSpec(), lambda step: None, lambda: None, lambda: True)
    guard.seed(earlier, upto=200)
    assert guard.head == [v for _, v in curve[:10]]
    spiked = [(s, v * 3) for s, v in curve[200:]]
    assert next(s for s, v in spiked if guard.observe(s, v)) < 210
