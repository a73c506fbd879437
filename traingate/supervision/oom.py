"""The opt-in OOM policy: retry with half the micro-batch and twice the gradient accumulation.

The global batch (micro x accumulation x world) stays the same, so the sampler, the
learning-rate schedule and the math of each optimizer step are unchanged.

>>> smaller_micro_batch(32, 1)
(16, 2)
>>> smaller_micro_batch(1, 4) is None
True
"""

from __future__ import annotations


def smaller_micro_batch(batch_size: int, grad_accum: int) -> tuple[int, int] | None:
    """(micro-batch, accumulation) to retry an OOM with, or None when it cannot shrink exactly."""
    if batch_size < 2 or batch_size % 2:
        return None
    return batch_size // 2, grad_accum * 2
