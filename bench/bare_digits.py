"""The bare baseline of ``python -m bench slurm``: the tiny digits training as a user writes it by hand, without
traingate, started by ``srun torchrun --standalone --nproc_per_node=N bench/bare_digits.py OUT STEPS``.

The same recipe code (the digits-cnn model, its data, its loss), the same batch size, optimizer and seed, DDP
over gloo, the same processes; no supervisor, tracking, checkpoints, heartbeats or alerts. Rank 0 writes
``OUT`` (JSON, epoch seconds): when its python started, its imports were done, the process group formed, and
its first training step ended. The bench subtracts this job's submit -> first step from traingate's.
"""

from __future__ import annotations

import json
import sys
import time

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from traingate.recipes.digits import DigitsNet, _read_digits
from traingate.recipes.facts import DigitsParams


def main(out: str, steps: int, batch: int = 16, lr: float = 0.05, seed: int = 0) -> None:
    marks = {"python": psutil.Process().create_time(), "imports": time.time()}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    marks["rendezvous"] = time.time()
    images, target = _read_digits()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.long)
    torch.manual_seed(seed)
    model = DDP(DigitsNet(DigitsParams(channels=8, hidden=32)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        ids = torch.randint(len(y), (batch * world,), generator=g)[rank::world]
        loss = F.cross_entropy(model(x[ids]), y[ids])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1:
            marks["first_step"] = time.time()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(marks, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
