"""Every RNG state survives a weights-only checkpoint round trip."""
from __future__ import annotations

import io
import random

import numpy as np
import torch

from traingate.runtime import rng


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.randn(1).item()


def test_restored_rng_state_reproduces_every_generator_after_a_weights_only_load():
    rng.seed_all(11)
    _draws()
    buf = io.BytesIO()
    torch.save(rng.capture(), buf)
    expected = _draws()
    _draws()  # move on
    buf.seek(0)
    rng.restore(torch.load(buf, weights_only=True))
    assert _draws() == expected
