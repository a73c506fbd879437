"""The recipe interface and the in-memory dataset every built-in recipe uses."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ValidationError

from traingate.spec import SpecError
from traingate.specbase import bool_for_number

if TYPE_CHECKING:
    from traingate.spec import RunSpec


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


class Recipe:
    """Model + data + loss + eval. Subclasses set ``name`` and ``Params``."""

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]]

    def __init__(self, spec: RunSpec):
        self.spec = spec
        for key, value in spec.recipe.params.items():
            field = self.Params.model_fields.get(key)
            why = bool_for_number(field.annotation, value) if field is not None else None
            if why:  # pydantic would take true/false as 1/0
                raise SpecError(f"recipe.params.{key} = {value!r}: {why}")
        try:
            self.params = self.Params.model_validate(spec.recipe.params)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise SpecError(
                f"recipe.params.{loc} = {err.get('input')!r}: {err['msg']} "
                f"(recipe {self.name!r} takes {sorted(self.Params.model_fields)})"
            ) from None

    # -- data
    def data_uri(self) -> str:
        """Where the data comes from (recorded with the run)."""
        raise NotImplementedError

    def data_snapshot(self) -> str:
        """Content hash of the data this recipe trains on."""
        train, val = self.load_data()
        return hashlib.sha256((train.content_hash() + val.content_hash()).encode()).hexdigest()

    def check_data(self) -> int:
        """Cheaply confirm the data exists; return the number of training samples. Raises SpecError."""
        raise NotImplementedError

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

    def tokens_per_sample(self) -> int:
        return 1
