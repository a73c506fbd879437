import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import Classifier, make_data  # noqa: E402


def test_output_has_one_logit_per_sample():
    x, _ = make_data(8)
    assert Classifier(4)(x).shape == (8,)


def test_gradients_reach_every_parameter():
    x, y = make_data(8)
    m = Classifier(4)
    torch.nn.functional.binary_cross_entropy_with_logits(m(x), y).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
