"""Distributed setup in one place: rank, world size, device, backend."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when running as a single plain process

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 300.0) -> DistInfo:
    """Join the process group torchrun described in the environment, if any.

    gloo on CPU, NCCL when CUDA is available. Without torchrun's variables this is a
    single process with no process group, and everything else behaves the same.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return DistInfo(0, 1, 0, device, None)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def close_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
