"""A resumable sampler that knows its exact data position.

The position is (epoch, offset): how many samples of the epoch's permutation have
been consumed. Each step takes the next ``global_batch`` ids of the permutation and
each rank takes its contiguous slice (:meth:`shard`), so a resumed run continues at
exactly the next sample. The permutation depends only on (seed, epoch), never on the
world size. The tail of an epoch shorter than a global batch is dropped.

What is guaranteed on resume:

* Same world size and batch: the resumed run consumes exactly the ids the
  uninterrupted run would have, step for step and rank for rank (and, with the RNG
  and optimizer state restored, computes bit for bit the same weights).
* Different world size (or batch): the position is in samples, not steps, so the run
  continues at the same offset of the same permutation - within the epoch no sample
  is skipped and none is seen twice. What changes: which rank sees which sample, the
  global batch (so the number of steps per epoch, and which tail is dropped at the
  epoch's end), and therefore the arithmetic of every later step; bitwise equality
  with an uninterrupted run holds only for the same world size and batch. Rank ``r``
  of the new world resumes the RNG streams saved by rank ``r mod old_world_size``.

>>> s = ResumableSampler(10, global_batch=4, seed=0)
>>> a = s.next_batch(); state = s.state_dict(); b = s.next_batch()
>>> t = ResumableSampler(10, global_batch=4, seed=0); t.load_state_dict(state)
>>> t.next_batch() == b
True
>>> u = ResumableSampler(10, global_batch=2, seed=0); u.load_state_dict(state)  # a smaller world
>>> u.next_batch() + u.next_batch() == b
True
"""

from __future__ import annotations

import torch


class ResumableSampler:
    def __init__(self, n: int, global_batch: int, seed: int, shuffle: bool = True):
        if global_batch > n:
            raise ValueError(
                f"global batch {global_batch} is larger than the {n} training samples; "
                "lower optim.batch_size or use more data"
            )
        self.n, self.global_batch, self.seed, self.shuffle = n, global_batch, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def permutation(self, epoch: int) -> list[int]:
        """The order in which epoch ``epoch`` visits the sample ids (a function of seed and epoch only)."""
        if not self.shuffle:
            return list(range(self.n))
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)).tolist()

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            self._perm = torch.tensor(self.permutation(self.epoch), dtype=torch.long)
            self._perm_epoch = self.epoch
        return self._perm

    def next_batch(self) -> list[int]:
        """The global batch of sample ids for the next step (the tail of an epoch is dropped)."""
        if self.offset + self.global_batch > self.n:
            self.epoch, self.offset = self.epoch + 1, 0
        ids = self._permutation()[self.offset : self.offset + self.global_batch].tolist()
        self.offset += self.global_batch
        return ids

    @staticmethod
    def shard(ids: list[int], rank: int, world_size: int) -> list[int]:
        per = len(ids) // world_size
        return ids[rank * per : (rank + 1) * per]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "n": self.n,
            "seed": self.seed,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n or state["seed"] != self.seed:
            raise ValueError(
                f"checkpoint sampler is for n={state['n']}, seed={state['seed']} but this run has "
                f"n={self.n}, seed={self.seed}; resume with the same data and optim.seed"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
