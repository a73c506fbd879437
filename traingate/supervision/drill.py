"""Fault-injection drills: break a run on purpose, check it still ends where an undisturbed run ends.

A drill trains a stage twice under the supervisor: once undisturbed (the reference),
once with a planned list of faults (:mod:`traingate.runtime.inject`). Exact resume
means the final weights and optimizer state must be bitwise equal. The report says what
was injected, how each fault was classified, how long recovery took and what it cost.

>>> faults = plan(["kill", "term", "stop", "io"], n=5, max_steps=30, world_size=2, seed=1, checkpoint_every=4)
>>> len(faults), len({f.kind for f in faults})
(5, 4)
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from traingate.job.stagejob import JobKind, derive
from traingate.job.vocab import DRILL_KINDS, Status
from traingate.runtime import inject
from traingate.runtime.checkpoint import Checkpointer
from traingate.settings import Settings
from traingate.spec import RunSpec, apply_overrides, parse_spec, write_resolved
from traingate.supervision.supervisor import Attempt, Hooks, Supervision, supervise

# What a drill may inject: the retryable faults. (oom/nan/error are stop-fast causes, tested separately.)
EXPECTED_CAUSE = {
    "kill": "worker_lost",
    "term": "preempted",
    "stop": "hang",
    "io": "transient_io",
    "ctimeout": "collective_timeout",
}


def plan(
    kinds: list[str], n: int, max_steps: int, world_size: int, seed: int, checkpoint_every: int | None = None
) -> list[inject.Fault]:
    """``n`` faults at random steps in [2, max_steps - 2], cycling through ``kinds``.

    Faults are spaced so each one ends a launch of its own: at least 2 steps apart, and an
    ``io`` fault (which surfaces only at the next save) two checkpoint intervals before the next.
    """
    unknown = sorted(set(kinds) - set(DRILL_KINDS))
    if unknown or not kinds:
        raise ValueError(f"drill kinds {unknown or kinds} unknown; use some of {', '.join(DRILL_KINDS)}")
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(order)
    gaps = [2 * checkpoint_every + 2 if k == "io" and checkpoint_every else 2 for k in order]
    slack = max_steps - 4 - sum(gaps[:-1])
    if slack < 0:
        raise ValueError(
            f"{n} faults ({', '.join(order)}) do not fit in {max_steps} steps; "
            "raise the stage's max_steps or lower --faults"
        )
    extra = sorted(rng.randint(0, slack) for _ in range(n))
    faults, pos = [], 2
    for kind, gap, e in zip(order, gaps, extra):
        rank = rng.randrange(world_size) if kind in ("kill", "stop", "ctimeout") else None
        faults.append(inject.Fault(kind, pos + e, rank))
        pos += gap
    return faults


@dataclass
class FaultRecord:
    fault: str
    kind: str
    fired_at_step: int
    classified_as: str | None
    recovery_s: float | None  # fault -> first step of the relaunched tree
    steps_lost: int | None  # steps done after the checkpoint resumed from, thrown away


@dataclass
class DrillReport:
    planned: list[str]
    faults: list[FaultRecord]
    recoveries: int
    reference_s: float
    drill_s: float
    steps: int
    steps_executed: int
    weights_equal: bool
    mismatched: list[str] = field(default_factory=list)
    status: Status = Status.COMPLETED
    error: str | None = None

    @property
    def time_lost_s(self) -> float:
        return self.drill_s - self.reference_s

    @property
    def steps_lost(self) -> int:
        return self.steps_executed - self.steps

    @property
    def goodput(self) -> float:
        return self.steps / self.steps_executed if self.steps_executed else 0.0

    @property
    def passed(self) -> bool:
        return self.status == Status.COMPLETED and self.weights_equal

    def render(self) -> str:
        lines = [
            f"drill {'PASSED' if self.passed else 'FAILED'}: {len(self.faults)} faults injected "
            f"({', '.join(sorted({f.kind for f in self.faults}))}), {self.recoveries} recoveries, "
            f"final weights {'bitwise equal to' if self.weights_equal else 'DIFFERENT from'} the undisturbed run",
            "",
            "| fault | fired at step | classified as | time to recovery (s) | steps lost |",
            "|---|---|---|---|---|",
        ]
        for f in self.faults:
            rec = f"{f.recovery_s:.1f}" if f.recovery_s is not None else "-"
            lines.append(
                f"| {f.fault} | {f.fired_at_step} | {f.classified_as or '-'} | {rec} | "
                f"{f.steps_lost if f.steps_lost is not None else '-'} |"
            )
        lines += [
            "",
            f"time: undisturbed {self.reference_s:.1f} s, drill {self.drill_s:.1f} s, lost {self.time_lost_s:.1f} s",
            f"steps: {self.steps} useful, {self.steps_executed} executed, {self.steps_lost} lost, "
            f"goodput {self.goodput:.1%}",
        ]
        if self.mismatched:
            lines.append(f"differing tensors: {', '.join(self.mismatched[:10])}")
        if self.error:
            lines += ["", f"error: {self.error.splitlines()[0]}"]
        return "\n".join(lines)


def final_state(checkpoint_uri: str) -> dict[str, Any]:
    ck = Checkpointer(checkpoint_uri, async_save=False)
    step = ck.find_latest()
    if step is None:
        raise ValueError(f"no checkpoint under {checkpoint_uri}")
    return ck.load(step)


def compare_states(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Paths of tensors (and values) that differ between two nested states; [] when bitwise equal."""

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [prefix or "<root>"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{prefix}.{k}" for k in set(a) ^ set(b)]
        for k in a.keys() & b.keys():
            out += compare_states(a[k], b[k], f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in compare_states(x, y, f"{prefix}[{i}]")]
    return [] if a == b else [prefix or "<root>"]


def _weights(state: dict[str, Any]) -> dict[str, Any]:
    # Model and optimizer state decide the next step; the rest (wall-clock RNG of samplers aside) follows.
    return {
        "model": state["model"],
        "optimizer": state["train_state"]["optimizer"],
        "step": state["train_state"]["step"],
    }


def records(sup: Supervision, fired: list[dict[str, Any]]) -> list[FaultRecord]:
    """Match each fired fault to the launch it ended and the launch that recovered from it."""
    out = []
    seen: set[str] = set()
    for m in fired:
        if m["fault"] in seen:
            continue  # a fault on every rank fires once per rank: report it once
        seen.add(m["fault"])
        # The launch it ended is the first that trained up to the step it fired at (a fault fires once): the
        # steps are the ranks' own record. Clocks are not: a relaunched group's process start (read from the
        # kernel) can be stamped a little before the marker the killed rank wrote just before it died. A launch's
        # end step is rank 0's last report, which may be a step behind the rank that fired (on a busy machine);
        # faults are planned at least 2 steps apart, so the launch before it never reaches the step before.
        step = int(m["step"])
        ended: Attempt | None = next(
            (
                a
                for a in sup.attempts
                if a.start_step is not None and a.end_step is not None and a.start_step <= step <= a.end_step + 1
            ),
            None,
        ) or next((a for a in sup.attempts if a.launched_at <= m["time"] <= (a.ended_at or float("inf"))), None)
        nxt = sup.attempts[ended.number + 1] if ended is not None and ended.number + 1 < len(sup.attempts) else None
        recovery = nxt.first_step_time - m["time"] if nxt is not None and nxt.first_step_time else None
        lost = None
        if ended is not None and nxt is not None and ended.end_step is not None and nxt.start_step is not None:
            lost = max(0, ended.end_step - nxt.start_step)
        out.append(FaultRecord(m["fault"], m["kind"], int(m["step"]), ended.cause if ended else None, recovery, lost))
    return out


def steps_executed(sup: Supervision) -> int:
    return sum(max(0, (a.end_step or 0) - (a.start_step or 0)) for a in sup.attempts)


def run_drill(
    spec: RunSpec,
    stage: str,
    faults: list[inject.Fault],
    work_dir: Path,
    hooks: Hooks | None = None,
    settings: Settings | None = None,
) -> DrillReport:
    """Train ``stage`` undisturbed, then again with ``faults``; compare the final states."""
    settings = settings or Settings.from_env()
    hooks = hooks or Hooks()
    # Every planned fault must be survivable: room in the retry budget for all of them.
    spec = parse_spec(
        apply_overrides(
            spec.to_dict(),
            [
                f"supervision.max_restarts={max(spec.supervision.max_restarts, len(faults) + 2)}",
                "tracking.enabled=false",
                "checkpoint.uri=null",
            ],
        )
    )
    shutil.rmtree(work_dir, ignore_errors=True)
    write_resolved(spec, work_dir / "spec.yaml")

    def one(name: str, injected: list[inject.Fault]) -> tuple[Supervision, float, str]:
        stage_dir = work_dir / name
        job = derive(
            spec,
            stage,
            run_id=f"drill-{name}",
            run_dir=work_dir,
            settings=settings,
            kind=JobKind.DRILL,
            stage_dir=stage_dir,
            checkpoint_uri=(stage_dir / "checkpoints").as_uri(),
            faults=inject.render(injected) or None,
        )
        hooks.info(f"drill: {name} run" + (f" with faults {job.faults}" if injected else ""))
        t0 = time.monotonic()
        sup = supervise(job, hooks=hooks)
        return sup, time.monotonic() - t0, job.checkpoint_uri

    ref, ref_s, ref_uri = one("reference", [])
    if ref.status != Status.COMPLETED:
        raise RuntimeError(f"the undisturbed run did not complete ({ref.error}); fix it before drilling")
    sup, drill_s, drill_uri = one("drill", faults)
    fired = inject.fired(work_dir / "drill")
    mismatched = (
        compare_states(_weights(final_state(ref_uri)), _weights(final_state(drill_uri)))
        if sup.status == Status.COMPLETED
        else ["<drill run did not complete>"]
    )
    return DrillReport(
        planned=[f.token for f in faults],
        faults=records(sup, fired),
        recoveries=sup.restarts,
        reference_s=ref_s,
        drill_s=drill_s,
        steps=getattr(spec.stages, stage).max_steps,
        steps_executed=steps_executed(sup),
        weights_equal=not mismatched,
        mismatched=mismatched,
        status=sup.status,
        error=sup.error,
    )
