"""digits-cnn: a small CNN on scikit-learn's bundled 8x8 digits (real data, offline)."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from traingate.recipes.base import Recipe, TensorData, device_of
from traingate.recipes.facts import DigitsFacts, DigitsParams


class DigitsNet(nn.Module):
    def __init__(self, p: DigitsParams):
        super().__init__()
        self.conv1 = nn.Conv2d(1, p.channels, 3, padding=1)
        self.conv2 = nn.Conv2d(p.channels, 2 * p.channels, 3, padding=1)
        self.fc1 = nn.Linear(2 * p.channels * 4 * 4, p.hidden)
        self.fc2 = nn.Linear(p.hidden, 10)
        self.drop = nn.Dropout(p.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 8x8 -> 4x4
        x = self.drop(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


class DigitsCNN(DigitsFacts, Recipe):
    def load_data(self) -> tuple[TensorData, TensorData]:
        images, target = _read_digits()
        x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(target, dtype=torch.long)
        # A fixed split (not the run seed): the data snapshot must not depend on the seed.
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
        x, y = x[perm], y[perm]
        n_val = max(1, int(round(len(y) * self.spec.data.val_fraction)))
        return TensorData((x[n_val:], y[n_val:])), TensorData((x[:n_val], y[:n_val]))

    def build_model(self) -> nn.Module:
        return DigitsNet(self.params)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: TensorData, batch_size: int) -> dict[str, Any]:
        total_loss, correct = 0.0, 0
        confusion = torch.zeros(10, 10, dtype=torch.long)
        for start in range(0, len(data), batch_size):
            x, y = data.batch(range(start, min(start + batch_size, len(data))), device_of(model))
            logits = model(x)
            total_loss += F.cross_entropy(logits, y, reduction="sum").item()
            pred = logits.argmax(1)
            correct += (pred == y).sum().item()
            confusion.index_put_((y.cpu(), pred.cpu()), torch.ones_like(y.cpu()), accumulate=True)
        return {
            "val_loss": total_loss / len(data),
            "val_accuracy": correct / len(data),
            "confusion": confusion.tolist(),
        }


def _read_digits() -> tuple[Any, Any]:
    """scikit-learn's bundled digits (8x8 images, labels), read from its CSV without importing scikit-learn.

    Same values as ``sklearn.datasets.load_digits()`` (tests/test_recipes check it), without the
    1-2 s import of scikit-learn and SciPy that every training process, and every restart, paid.
    """

    spec = importlib.util.find_spec("sklearn")  # locates the package without running its __init__
    if spec is None or spec.origin is None:
        raise RuntimeError("digits-cnn needs scikit-learn's bundled digits data: pip install scikit-learn")
    with gzip.open(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", "rt") as f:
        rows = np.loadtxt(f, delimiter=",")
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(int)
