"""What the supervisor decides from a running stage's heartbeats (read with :mod:`traingate.job.files`).

Each rank writes ``heartbeat.rank<r>.json`` ({step, time, pid, start_step, first_step_time,
phase, restart_count}) after every step, and with phase ``preempting``/``finishing`` when it leaves the loop.
A run is hung when some rank's step has not advanced for the hang timeout, or when a rank has not written
its first heartbeat within the startup timeout
(which also bounds the work after the last step: final checkpoint, evaluation, exit).

>>> hang_timeout(canary_p99_s=0.4, floor_s=60.0)
60.0
>>> hang_timeout(canary_p99_s=90.0, floor_s=60.0)
180.0
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil

from traingate.job.files import Heartbeat


def hang_timeout(canary_p99_s: float | None, floor_s: float, factor: float = 2.0) -> float:
    """Default hang timeout: ``factor`` x the canary's p99 step time, never below ``floor_s``."""
    return max(floor_s, factor * canary_p99_s) if canary_p99_s else floor_s


@dataclass
class HangDetector:
    """Watches per-rank heartbeats of one launch (wall-clock ``time.time()`` seconds)."""

    timeout_s: float
    startup_timeout_s: float  # also bounds the end: final checkpoint, evaluation, shutdown
    world_size: int
    launched_at: float
    final_step: int | None = None
    # What a "step" is: a training step (heartbeats), or a script's output line / metric step (its output).
    progress: str = "step"
    _last: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (step, when it last advanced)
    _exited: set[int] = field(default_factory=set)  # gone, preempting or finishing

    def observe(self, heartbeats: dict[int, Heartbeat], now: float, exited: set[int] | None = None) -> None:
        """``exited``: ranks whose process is gone; the tree is winding down, not hung."""
        self._exited |= exited or set()
        for rank, hb in heartbeats.items():
            if hb.phase != "train":
                self._exited.add(rank)  # preempting or finishing: bounded by the startup timeout
            prev = self._last.get(rank)
            if prev is None or hb.step != prev[0]:
                # Trust the rank's own timestamp for when it advanced, but not a future one.
                self._last[rank] = (hb.step, min(now, float(hb.time)))

    def _overdue(self, now: float) -> list[tuple[int, int, float, bool, float]]:
        """(rank, step, seconds still, finishing, limit) of every rank past its limit, once all ranks reported."""
        out = []
        for rank, (step, since) in sorted(self._last.items()):
            finishing = rank in self._exited or self.final_step is not None and step >= self.final_step
            limit = self.startup_timeout_s if finishing else self.timeout_s
            if now - since > limit:
                out.append((rank, step, now - since, finishing, limit))
        return out

    def stuck_ranks(self, now: float) -> list[int]:
        """Ranks that reported steps and then stopped advancing for the hang timeout (not start-up stalls)."""
        if len(self._last) < self.world_size:
            return []
        return [rank for rank, _, _, finishing, _ in self._overdue(now) if not finishing]

    def stalled(self, now: float) -> str | None:
        """Why the run looks hung, or None."""
        if len(self._last) < self.world_size:
            if now - self.launched_at > self.startup_timeout_s:
                missing = sorted(set(range(self.world_size)) - set(self._last))
                if self.progress != "step":
                    return (
                        f"the script printed no {self.progress} within {self.startup_timeout_s:.0f} s of launch "
                        "(supervision.startup_timeout_s)"
                    )
                return (
                    f"rank(s) {missing} wrote no heartbeat within {self.startup_timeout_s:.0f} s of launch "
                    "(supervision.startup_timeout_s)"
                )
            return None
        for rank, step, still, finishing, limit in self._overdue(now)[:1]:
            if self.progress != "step":
                return (
                    f"the script printed no new {self.progress} for {still:.1f} s after {self.progress} {step} "
                    f"(timeout {limit:.1f} s, supervision.hang_timeout_s)"
                )
            what = f"finishing after step {step}" if finishing else f"stuck at step {step}"
            return f"rank {rank} {what} for {still:.1f} s (timeout {limit:.1f} s)"
        return None


def checkpoint_stale(
    step: int,
    last_checkpoint_step: int,
    every_steps: int | None,
    seconds_since_checkpoint: float,
    every_s: float | None,
    factor: float = 2.0,
) -> str | None:
    """Alert text when no new checkpoint arrived within ``factor`` x the checkpoint interval, else None
    (``factor``: alerts.checkpoint_stale.factor).

    >>> checkpoint_stale(step=120, last_checkpoint_step=50, every_steps=25,
    ...                  seconds_since_checkpoint=10.0, every_s=None)
    'no checkpoint for 70 steps (interval 25 steps, limit 2x)'
    """
    if every_steps and step - last_checkpoint_step > factor * every_steps:
        return (
            f"no checkpoint for {step - last_checkpoint_step} steps (interval {every_steps} steps, limit {factor:g}x)"
        )
    if every_s and seconds_since_checkpoint > factor * every_s:
        return f"no checkpoint for {seconds_since_checkpoint:.3g} s (interval {every_s:.3g} s, limit {factor:g}x)"
    return None


def exited_ranks(heartbeats: dict[int, Heartbeat]) -> set[int]:
    """Ranks whose heartbeat pid no longer runs (gone, or a zombie waiting for torchrun to reap it)."""

    out = set()
    for rank, hb in heartbeats.items():
        try:
            if psutil.Process(int(hb.pid)).status() == psutil.STATUS_ZOMBIE:
                out.add(rank)
        except (psutil.NoSuchProcess, ValueError):
            out.add(rank)
        except psutil.Error:
            pass
    return out
