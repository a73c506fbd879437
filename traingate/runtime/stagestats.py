"""What a stage's summary says of its training as a whole, carried in its checkpoints.

A stage may train over several processes (a preemption, a lost worker, smoke's two halves, a resume
after the CLI was killed). Its gate reads ``loss_decrease_fraction``, ``nonfinite_steps`` and
``max_grad_norm`` as facts of the stage, so they cannot be measured over the last process's steps
only: a canary preempted at step 10 of 20 would be judged on its flatter second half. The stage's
first losses, its latest ones and its counts travel in the checkpoint's training state; an exact
resume restores them with the weights, and the summary equals the one an uninterrupted stage writes.

>>> s = StageStats()
>>> for loss in [4.0, 3.0, 2.0, 1.0]:
...     s.observe(loss, grad_norm=0.5, finite=True)
>>> resumed = StageStats.from_state(s.state_dict())
>>> for loss in [1.0, 0.5, 0.5, 0.5]:
...     resumed.observe(loss, grad_norm=2.0, finite=True)
>>> m = resumed.summary()
>>> m["first_loss"], m["final_loss"], m["loss_decrease_fraction"], m["max_grad_norm"]
(3.5, 0.5, 0.8571428571428571, 2.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SMOOTH = 5  # the ends of the loss curve are averaged over up to this many steps (a quarter of the stage at most)


@dataclass
class StageStats:
    head: list[float] = field(default_factory=list)  # the stage's first SMOOTH finite losses
    tail: list[float] = field(default_factory=list)  # its latest SMOOTH finite losses
    finite: int = 0  # steps with a finite loss
    nonfinite: int = 0  # steps whose loss or gradient was not finite
    max_grad: float = 0.0

    def observe(self, loss: float, grad_norm: float, finite: bool) -> None:
        if not finite:
            self.nonfinite += 1
            return
        self.finite += 1
        if len(self.head) < SMOOTH:
            self.head.append(loss)
        self.tail = [*self.tail[-(SMOOTH - 1) :], loss]
        self.max_grad = max(self.max_grad, grad_norm)

    def summary(self) -> dict[str, float | int]:
        """``nonfinite_steps`` and ``max_grad_norm``; with a finite step, the smoothed first and final loss and
        the fraction the loss decreased by over the stage."""
        m: dict[str, float | int] = {"nonfinite_steps": self.nonfinite, "max_grad_norm": self.max_grad}
        if self.finite:
            k = max(1, min(SMOOTH, self.finite // 4))
            first, last = sum(self.head[:k]) / k, sum(self.tail[-k:]) / k
            m.update(
                first_loss=first, final_loss=last, loss_decrease_fraction=(first - last) / first if first > 0 else 0.0
            )
        return m

    def state_dict(self) -> dict[str, Any]:
        """Plain lists and numbers: a checkpoint loads it with ``weights_only=True``."""
        return {
            "head": list(self.head),
            "tail": list(self.tail),
            "finite": self.finite,
            "nonfinite": self.nonfinite,
            "max_grad": self.max_grad,
        }

    @classmethod
    def from_state(cls, state: Any) -> StageStats:
        """The stats a checkpoint carried; a checkpoint written without them starts the count at its step."""
        if not isinstance(state, dict):
            return cls()
        return cls(
            [float(x) for x in state.get("head", [])],
            [float(x) for x in state.get("tail", [])],
            int(state.get("finite", 0)),
            int(state.get("nonfinite", 0)),
            float(state.get("max_grad", 0.0)),
        )
