"""What a stage on a Slurm pool cost, from Slurm's accounting: every allocation its jobs held.

A stage attempt is one Slurm job, and a job preempted and requeued runs again under the same id in a
new allocation; ``sacct -D --json`` keeps one record per allocation (plain ``sacct`` shows only the
newest). Each record is charged as the ledger charges an attempt (:func:`traingate.cost.ledger.charge`):
``elapsed x allocated gres/gpu x the pool's price_per_gpu_hour``. So a requeued stage pays for every
allocation it held, and time spent pending costs nothing. Idle is the part of an allocation before its
first completed training step (from the supervisor's attempts, whose clocks are the nodes'), or all of
an allocation that never completed one. Pure: the sacct text comes in, ledger attempts go out.

>>> text = (
...     '{"jobs": [{"job_id": 7, "state": {"current": "REQUEUED"}, "time": {"start": 100, "end": 160, '
...     '"elapsed": 60}, "tres": {"allocated": [{"type": "gres", "name": "gpu", "count": 4}, '
...     '{"type": "gres", "name": "gpu:a100", "count": 4}]}}]}'
... )
>>> [(a.state, a.start, a.end, a.gpus) for a in allocations(text, "7")]
[('REQUEUED', 100, 160, 4)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from traingate.capacity.slurm import _load, _num, _state_word
from traingate.cost.ledger import Attempt, Outcome
from traingate.job.vocab import Status

# Record states of an allocation that ended so the job could run again (requeued after a preemption
# or a node failure): charged as preempted, the work before it is resumed from its checkpoint.
_REQUEUED = frozenset({"REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL"})


@dataclass(frozen=True)
class Allocation:
    """One allocation of a job as ``sacct -D --json`` records it."""

    job_id: str
    state: str
    start: int  # epoch seconds
    end: int
    gpus: int  # allocated TRES gres/gpu, every node together


def _gpus(tres: dict[str, Any]) -> int:
    # 22.05 lists gres/gpu once untyped and once per type (gpu:a100): the untyped entry is the total.
    alloc = tres.get("allocated") or []
    return sum(_num(t.get("count")) or 0 for t in alloc if t.get("type") == "gres" and t.get("name") == "gpu")


def allocations(text: str, job_id: str) -> list[Allocation]:
    """Every allocation ``sacct -D -j JOB_ID --json`` printed for the job, oldest first; a record that never
    started (cancelled while pending: sacct gives it a start and 0 s elapsed) held nothing and is left out."""
    out = []
    for j in _load(text, "sacct").get("jobs") or []:
        if str(j.get("job_id")) != str(job_id):
            continue
        t = j.get("time") or {}
        start, end, elapsed = _num(t.get("start")), _num(t.get("end")), _num(t.get("elapsed"))
        if not start or not elapsed or (end and end < start):
            continue
        state = _state_word((j.get("state") or {}).get("current"))
        out.append(Allocation(str(j["job_id"]), state, start, start + elapsed, _gpus(j.get("tres") or {})))
    return sorted(out, key=lambda a: a.start)


def _idle_s(a: Allocation, supervised: Sequence[dict[str, Any]]) -> float:
    firsts = [
        float(s["first_step_time"])
        for s in supervised
        if s.get("first_step_time") is not None and a.start <= float(s["first_step_time"]) <= a.end
    ]
    return float(min(firsts) - a.start) if firsts else float(a.end - a.start)


def charged(
    run_id: str,
    stage: str,
    pool: str,
    price_per_gpu_hour: float,
    allocs: Sequence[Allocation],
    final: Status,
    requested_gpus: int,
    supervised: Sequence[dict[str, Any]] = (),
) -> list[Attempt]:
    """The stage's allocations (every job of it, in order) as ledger attempts numbered 0.. . ``final``: how the
    stage ended (the last allocation's outcome); ``supervised``: the supervisor's attempts (``asdict``), for idle.
    ``requested_gpus``: what the job asked for, charged for an allocation whose record has no gres/gpu (a
    controller without ``AccountingStorageTRES=gres/gpu``; :func:`untracked_gpus` names them for a warning).
    """
    out = []
    for n, a in enumerate(allocs):
        last = n == len(allocs) - 1
        if last:
            outcome = (
                Outcome.COMPLETED
                if final == Status.COMPLETED
                else Outcome.PREEMPTED
                if final == Status.PREEMPTED
                else Outcome.FAILED
            )
        else:
            outcome = (
                Outcome.COMPLETED
                if a.state == "COMPLETED"
                else Outcome.PREEMPTED
                if a.state in _REQUEUED
                else Outcome.FAILED
            )
        out.append(
            Attempt(
                run_id,
                stage,
                n,
                pool,
                a.gpus or requested_gpus,
                price_per_gpu_hour,
                float(a.start),
                float(a.end),
                outcome,
                idle_s=_idle_s(a, supervised),
            )
        )
    return out


def untracked_gpus(allocs: Sequence[Allocation]) -> str | None:
    """One line for the log when some allocation's record lacks gres/gpu (charged at the requested GPUs), else None."""
    ids = sorted({a.job_id for a in allocs if a.gpus < 1})
    if not ids:
        return None
    return (
        f"sacct shows no gres/gpu allocated for Slurm job(s) {', '.join(ids)}: charged at the GPUs the stage "
        "requested; add AccountingStorageTRES=gres/gpu to slurm.conf so the charge is what Slurm allocated"
    )
