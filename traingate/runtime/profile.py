"""Step timing: the numbers a sizing estimate is made from."""

from __future__ import annotations

import resource
import time

import torch


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


class StepProfile:
    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.data_waits: list[float] = []
        self.last_data_wait = 0.0
        self.startup_s: float | None = None

    def started(self, launch_ts: float | None) -> None:
        """Called just before the first step: startup is launch -> here."""
        if launch_ts is not None:
            self.startup_s = max(0.0, time.time() - launch_ts)

    def data_wait(self, seconds: float) -> None:
        self.last_data_wait = seconds
        self.data_waits.append(seconds)

    def step(self, seconds: float) -> None:
        self.step_times.append(seconds)

    def summary(self, global_batch: int, tokens_per_sample: int) -> dict[str, float]:
        # The first step pays one-off costs (allocator, DDP buckets); keep it out of the distribution.
        st = self.step_times[1:] or self.step_times
        mean = sum(st) / len(st) if st else 0.0
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        out = {
            "step_time_mean_s": mean,
            "step_time_p50_s": percentile(st, 50),
            "step_time_p90_s": percentile(st, 90),
            "step_time_p99_s": percentile(st, 99),
            "first_step_s": self.step_times[0] if self.step_times else 0.0,
            "samples_per_s": global_batch / mean if mean else 0.0,
            "tokens_per_s": global_batch * tokens_per_sample / mean if mean else 0.0,
            "data_wait_mean_s": sum(self.data_waits) / len(self.data_waits) if self.data_waits else 0.0,
            "data_wait_fraction": (sum(self.data_waits) / sum(self.step_times)) if self.step_times else 0.0,
            "peak_memory_mb": peak,
            "measured_steps": float(len(self.step_times)),
        }
        if self.startup_s is not None:
            out["startup_s"] = self.startup_s
        return out
