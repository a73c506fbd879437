"""Fault injection inside the training process, for tests and drills (``TRAINGATE_INJECT``).

``TRAINGATE_INJECT="kill@7:1,io@10,stop@13:0"``: a comma-separated list of
``kind@step[:rank]`` (no rank: every rank). A fault fires when the rank is about to
run the step after ``step`` (for ``io``: at the first checkpoint save at or after
``step``). Each fault fires once per stage directory: a marker under
``<stage_dir>/faults/`` remembers it, so the relaunched process does not repeat it.
The marker also records when it fired, which a drill reports time to recovery from.

Kinds: ``kill`` SIGKILL this rank (worker lost) - ``stop`` SIGSTOP this rank (hang) -
``term`` SIGTERM the whole process tree (preemption) - ``io`` the checkpoint store
fails with EIO - ``oom`` raise torch.OutOfMemoryError - ``nan`` poison the weights
(divergence) - ``ctimeout`` raise the error a timed-out collective raises - ``error``
raise a RuntimeError, as a bug in recipe code would - ``slow`` from that step on, the rank
sleeps 0.1 s every step (a straggler; not one-shot: it lasts as long as the variable is set) -
``spike`` multiply every weight by 8: the loss jumps and stays up (a loss spike to roll back from) -
``savestop`` SIGSTOP this rank in the middle of its first checkpoint save at or after that step, its files
written and its manifest not (whatever kills the stopped tree leaves a save cut short).

>>> [f.token for f in parse("kill@7:1, io@10")]
['kill@7:1', 'io@10']
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from traingate.job import envvars

ENV = envvars.INJECT
KINDS = ("kill", "stop", "term", "io", "oom", "nan", "ctimeout", "error", "slow", "spike", "savestop")
SLOW_STEP_S = 0.1
SPIKE_FACTOR = 8.0


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None

    @property
    def token(self) -> str:
        return f"{self.kind}@{self.step}" + ("" if self.rank is None else f":{self.rank}")

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, rest = item.partition("@")
        step, _, rank = rest.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV} item {item!r}: expected kind@step[:rank] with kind one of {', '.join(KINDS)}")
        faults.append(Fault(kind, int(step), int(rank) if rank else None))
    return faults


def render(faults: list[Fault]) -> str:
    return ",".join(f.token for f in faults)


def fired(stage_dir: Path) -> list[dict[str, Any]]:
    """The markers of faults that fired in this stage directory, oldest first."""
    out = []
    for p in (stage_dir / "faults").glob("*.json"):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda m: m["time"])


class Injector:
    def __init__(self, faults: list[Fault], rank: int, marker_dir: Path):
        self.faults = [f for f in faults if f.applies_to(rank)]
        self.rank, self.marker_dir = rank, marker_dir

    @classmethod
    def from_plan(cls, plan: str, rank: int, stage_dir: Path) -> Injector:
        return cls(parse(plan), rank, stage_dir / "faults")

    def _take(self, kinds: tuple[str, ...], step: int, exact: bool) -> Fault | None:
        for f in self.faults:
            if f.kind in kinds and (f.step == step if exact else step >= f.step):
                marker = self.marker_dir / f"{f.token.replace(':', '-r')}.rank{self.rank}.json"
                if marker.exists():
                    continue
                self.marker_dir.mkdir(parents=True, exist_ok=True)
                marker.write_text(
                    json.dumps(
                        {
                            "fault": f.token,
                            "kind": f.kind,
                            "step": step,
                            "rank": self.rank,
                            "time": time.time(),
                            "pid": os.getpid(),
                        }
                    )
                )
                return f
        return None

    def before_step(self, step: int, model: Any) -> None:
        """Called at the top of each training step with the number of steps done so far."""
        if any(f.kind == "slow" and step >= f.step for f in self.faults):
            time.sleep(SLOW_STEP_S)
        f = self._take(("kill", "stop", "term", "oom", "nan", "ctimeout", "error", "spike"), step, exact=True)
        if f is None:
            return
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "stop":
            stop_here()
        elif f.kind == "term":
            _preempt_tree()
        elif f.kind == "nan":
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        elif f.kind == "spike":
            # A bad update's aftermath: weights blown up, the loss jumps and stays up. Once per stage
            # (its marker), so a roll-back past it trains on as if the bad batch had been skipped.
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(SPIKE_FACTOR)
        elif f.kind == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected fault)")
        elif f.kind == "ctimeout":
            raise dist.DistBackendError(
                "[gloo] Timed out waiting 300000ms for recv operation to complete (injected fault)"
            )
        elif f.kind == "error":
            raise RuntimeError(f"injected bug in recipe code at step {step}")

    def storage_hook(self, phase: str, step: int) -> None:
        """A checkpoint fault hook: the store fails (EIO) at the first save at or after an ``io`` step."""
        if phase == "tensor_write" and self._take(("io",), step, exact=False) is not None:
            raise OSError(errno.EIO, f"injected transient storage failure at checkpoint step {step}")
        if phase == "before_manifest" and self._take(("savestop",), step, exact=False) is not None:
            stop_here()


def stop_here() -> None:
    """SIGSTOP this process from the calling thread, which goes no further.

    Sent to the thread, not the process: a process-wide SIGSTOP is taken by whichever thread the kernel picks
    (the main one when it can), and until that thread runs on a busy machine the caller (an async save's
    writer) goes on and writes what the fault is meant to cut short. Sent to itself, the caller handles the
    stop on its way back from the call, and a stop signal stops every thread of the process.
    """
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _preempt_tree() -> None:
    """SIGTERM the whole training tree, as a preempting scheduler would: torchrun's agent and every worker."""

    me = psutil.Process()
    targets = [me]
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: each worker sits in a session of its own
        agent = me.parent()
        targets = [agent, *agent.children()]
    for p in targets:
        p.send_signal(signal.SIGTERM)


def chain(*hooks: Callable[[str, int], None] | None) -> Callable[[str, int], None] | None:
    """One checkpoint fault hook calling each given hook in turn (None when there are none)."""
    live = [h for h in hooks if h is not None]
    if not live:
        return None

    def hook(phase: str, step: int) -> None:
        for h in live:
            h(phase, step)

    return hook
