"""The recipe interface and the in-memory dataset every built-in recipe uses."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from traingate.recipes.facts import RecipeFacts


@dataclass
class TensorData:
    """Samples held as tensors, addressed by integer sample id (0..n-1).

    Batches are gathered by id, so the sampler's position alone decides what a
    step sees: that is what makes resume exact.
    """

    tensors: tuple[torch.Tensor, ...]

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0])

    def batch(self, ids: Sequence[int], device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(list(ids), dtype=torch.long)
        out = tuple(t.index_select(0, index) for t in self.tensors)
        return out if device is None else tuple(t.to(device, non_blocking=True) for t in out)

    def head(self, n: int) -> TensorData:
        return TensorData(tuple(t[:n] for t in self.tensors))

    def content_hash(self) -> str:
        h = hashlib.sha256()
        for t in self.tensors:
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def device_of(model: torch.nn.Module) -> torch.device:
    """Where a model's weights live: evaluation batches go there (a CUDA model cannot read CPU tensors)."""
    return next(model.parameters()).device


class Recipe(RecipeFacts):
    """Model + data + loss + eval: a recipe's training code over its facts (``name``, ``Params``, data)."""

    def data_snapshot(self) -> str:
        """Content hash of the data this recipe trains on."""
        train, val = self.load_data()
        return hashlib.sha256((train.content_hash() + val.content_hash()).encode()).hexdigest()

    def load_data(self) -> tuple[TensorData, TensorData]:
        """(train, val)."""
        raise NotImplementedError

    # -- model
    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, data: TensorData, batch_size: int) -> dict[str, Any]:
        raise NotImplementedError
