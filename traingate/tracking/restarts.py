"""A stage's restarts, from their one record: the supervisor's attempts (``supervisor.json``).

`traingate watch` reads them from the stage directory while the stage runs; the stage's result carries
them (its ``restarts`` metric); when the stage is recorded, its MLflow run gets them as the tags
``traingate.restart_count`` and ``traingate.restart_record``, which `traingate show`, `traingate runs`
and ``pipeline.restarts`` read (:func:`traingate.tracking.runs.restarts`). So a script stage, which has
no tracker of its own, and a built-in one are counted alike, everywhere.

>>> attempts = [{"cause": "worker_lost", "ended_at": 10.0, "end_step": 30, "launched_at": 0.0},
...             {"cause": None, "launched_at": 12.5, "resume_from_step": 20, "ended_at": 40.0}]
>>> records(attempts, final=True)
[{'n': '1', 'cause': 'worker_lost', 'resumed_from_step': '20', 'steps_lost': '10', 'downtime_s': '2.5'}]
>>> records([{"cause": "worker_lost", "ended_at": 10.0, "end_step": 710},
...          {"cause": None, "launched_at": 11.0, "resume_step_unknown": True}], final=True)[0]["resumed_from_step"]
'unknown'
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from traingate.job.vocab import Status

# A process that follows its predecessor's deliberate end continues the stage: the smoke stage stops
# half way at a checkpoint and resumes on purpose, to prove the wiring. Only failures and preemptions
# (a Cause, or "unknown" when a process died without a word) are restarts.
_DELIBERATE_ENDS = frozenset({Status.STOPPED, Status.COMPLETED, Status.PRUNED})

COUNT_TAG = "traingate.restart_count"
RECORD_TAG = "traingate.restart_record"
_TAG_LIMIT = 5000  # MLflow keeps tag values up to 8000 characters; the count tag holds the full number


def is_restart(cause: str | None) -> bool:
    """Whether a new process of a stage, started because of ``cause`` (how the previous one ended),
    counts as a restart. The one rule of every restart count.

    >>> is_restart("worker_lost"), is_restart("preempted"), is_restart("stopped")
    (True, True, False)
    """
    return cause not in _DELIBERATE_ENDS


def restart_message(n: int, cause: str, resumed_from_step: int, lost_s: float) -> tuple[int, str]:
    """(log level, line) for the ``n``-th new process of a run: a restart after a failure or a preemption is a
    WARNING; a process that continues after a deliberate end (the smoke stage's planned stop at its half-way
    checkpoint) is normal progress, said at INFO and not called a restart.

    >>> restart_message(1, "worker_lost", 20, 3.5)
    (30, 'restart 1 of this run (cause worker_lost): resumed from step 20, 3.5 s lost')
    >>> restart_message(1, "stopped", 3, 0.0)
    (20, 'process 2 of this run continues from step 3 after the planned stop at that checkpoint (stopped)')
    """
    if is_restart(cause):
        line = f"restart {n} of this run (cause {cause}): resumed from step {resumed_from_step}, {lost_s:.1f} s lost"
        return logging.WARNING, line
    return (
        logging.INFO,
        f"process {n + 1} of this run continues from step {resumed_from_step} after the planned stop at that "
        f"checkpoint ({cause})",
    )


def records(attempts: Sequence[Mapping[str, Any]], final: bool) -> list[dict[str, str]]:
    """One record per restart: number, cause, step resumed from ('unknown' when the checkpoint's name
    holds no step, '' while the next launch is still to come), steps lost and downtime (failure seen ->
    next launch). ``final``: the stage has ended, so its last attempt was followed by nothing."""
    followed = list(attempts[:-1]) if final else [a for a in attempts if a.get("ended_at") is not None]
    out: list[dict[str, str]] = []
    for i, a in enumerate(followed):
        if not is_restart(a.get("cause")):
            continue
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        rec = {"n": str(len(out) + 1), "cause": str(a.get("cause") or "unknown"), "resumed_from_step": ""}
        if nxt is not None:
            if nxt.get("resume_step_unknown"):
                rec["resumed_from_step"] = "unknown"  # and so are the steps lost: none are counted
            else:
                step = int(nxt.get("resume_from_step") or 0)
                rec["resumed_from_step"] = str(step)
                if a.get("end_step") is not None:
                    rec["steps_lost"] = str(max(0, int(a["end_step"]) - step))
            if nxt.get("launched_at") is not None and a.get("ended_at") is not None:
                rec["downtime_s"] = f"{max(0.0, float(nxt['launched_at']) - float(a['ended_at'])):g}"
        out.append(rec)
    return out


def tags(recs: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The stage run's tags for ``recs`` (the newest records that fit, and the full count)."""
    kept = list(recs)
    text = json.dumps(kept, separators=(",", ":"))
    while len(text) > _TAG_LIMIT and kept:
        kept = kept[1:]
        text = json.dumps(kept, separators=(",", ":"))
    return {COUNT_TAG: str(len(recs)), RECORD_TAG: text}


def from_tags(run_tags: Mapping[str, str]) -> tuple[int, list[dict[str, str]]] | None:
    """(count, records) a recorded stage run holds; None for a run that was never recorded (still running)."""
    if COUNT_TAG not in run_tags:
        return None
    return int(run_tags[COUNT_TAG]), json.loads(run_tags.get(RECORD_TAG) or "[]")
