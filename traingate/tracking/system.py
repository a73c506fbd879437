"""Per-rank system signals: step time, CPU, host memory, GPU utilisation and memory.

Every rank samples its own process; one small all-gather at logging steps brings the
numbers to rank 0, which logs them under ``system/rank<r>/...`` plus cross-rank
aggregates, so only rank 0 writes to the run. GPU signals come from NVML and are left
out where there is no NVIDIA driver (a normal state on CPU machines).

>>> s = SystemSignals(rank=0, world_size=1, enabled=True)
>>> sorted(s.collect(0.01))
['system/host_memory_percent', 'system/rank0/cpu_percent', 'system/rank0/rss_mb', 'system/rank0/step_time_s']
>>> SystemSignals(rank=0, world_size=1, enabled=False).collect(0.01)
{}
"""

from __future__ import annotations

import math
import os
from typing import Any

import psutil
import pynvml
import torch
import torch.distributed as dist

_FIELDS = ("step_time_s", "cpu_percent", "rss_mb", "host_memory_percent", "gpu_util_percent", "gpu_memory_mb")


def _nvml_handle(local_rank: int) -> Any:
    try:
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(local_rank)
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound and friends: no GPU here, not an error
        return None


class SystemSignals:
    def __init__(self, rank: int, world_size: int, enabled: bool, device: Any = None):
        self.rank, self.world_size, self.enabled = rank, world_size, enabled
        self.device = device
        if not enabled:
            return

        self._psutil = psutil
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # primes the counter: later calls measure since the previous one
        self._gpu = _nvml_handle(int(os.environ.get("LOCAL_RANK", "0")))

    def _sample(self, step_time_s: float) -> list[float]:
        gpu_util = gpu_mem = math.nan
        if self._gpu is not None:
            gpu_util = float(pynvml.nvmlDeviceGetUtilizationRates(self._gpu).gpu)
            gpu_mem = pynvml.nvmlDeviceGetMemoryInfo(self._gpu).used / 2**20
        return [
            step_time_s,
            self._proc.cpu_percent(None),
            self._proc.memory_info().rss / 2**20,
            self._psutil.virtual_memory().percent,
            gpu_util,
            gpu_mem,
        ]

    def collect(self, step_time_s: float) -> dict[str, float]:
        """Called by every rank at the same steps; rank 0 gets the metrics, the others ``{}``."""
        if not self.enabled:
            return {}
        rows = [self._sample(step_time_s)]
        if self.world_size > 1:
            mine = torch.tensor(rows[0], dtype=torch.float64, device=self.device)
            everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(everyone, mine)
            rows = [t.tolist() for t in everyone]
        if self.rank != 0:
            return {}
        out: dict[str, float] = {}
        for r, row in enumerate(rows):
            for name, v in zip(_FIELDS, row):
                if name != "host_memory_percent" and not math.isnan(v):
                    out[f"system/rank{r}/{name}"] = v
        if len(rows) == 1:
            out["system/host_memory_percent"] = rows[0][3]
            return out  # one rank: aggregates would repeat it
        step_times = [row[0] for row in rows]
        out["system/step_time_max_s"] = max(step_times)
        out["system/step_time_mean_s"] = sum(step_times) / len(step_times)
        out["system/cpu_percent_mean"] = sum(row[1] for row in rows) / len(rows)
        out["system/host_memory_percent"] = rows[0][3]
        gpu = [row[4] for row in rows if not math.isnan(row[4])]
        if gpu:
            out["system/gpu_util_percent_mean"] = sum(gpu) / len(gpu)
        return out
