"""Distributed setup in one function: a plain process is rank 0 of 1, with nothing to tear down."""
from __future__ import annotations

import torch

from traingate.runtime.dist import close_distributed, init_distributed


def test_a_process_without_torchrun_is_rank_0_of_a_world_of_1(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    d = init_distributed()
    assert (d.rank, d.world_size, d.local_rank, d.is_main, d.backend) == (0, 1, 0, True, None)
    assert d.device == torch.device("cuda", 0) if torch.cuda.is_available() else d.device == torch.device("cpu")
    close_distributed()  # no process group: nothing to do, no error
