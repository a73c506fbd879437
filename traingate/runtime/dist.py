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
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
            **_attempt_store(world, rank, timeout_s),
        )
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def _attempt_store(world: int, rank: int, timeout_s: float) -> dict:
    """Under torchrun with the agent's store, a store namespace of this group incarnation's own.

    The agent keeps one TCPStore across in-place restarts of the group, and the process group's keys
    (each rank's gloo/NCCL address) are not namespaced by restart: a restarted rank read its dead
    predecessor's address and gave up after gloo's connect retries ("connection refused"). Prefixing by
    TORCHELASTIC_RESTART_COUNT gives every incarnation fresh keys.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"traingate/attempt_{attempt}", store), "rank": rank, "world_size": world}


def close_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
