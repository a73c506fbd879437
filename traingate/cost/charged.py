"""A stage's charge as its stage directory holds it: what `traingate watch` and the run's budget add up.

Every dollar goes through the ledger: :func:`traingate.cost.ledger.charge` per attempt, added up by
:func:`traingate.cost.ledger.total_usd`. The StageResult's ``cost_usd`` (MLflow's ``stage.cost_usd``,
the ``pipeline.cost_usd`` of the run, `traingate runs` and `show`) and `traingate cost` come from the
same attempts through the same function, so every view shows one total for a run.

- An ended stage: the attempts recorded with its result (``charged.json``, final), while they cover
  every attempt supervisor.json holds (a resumed stage's new supervision holds more).
- A stage going on: the attempts ``charged.json`` holds that supervisor.json does not (smoke's first
  half, once the second half runs), supervisor.json's ended attempts at job.json's pool, slots and
  price, and the launch still running, up to ``now``.

>>> import tempfile; d = Path(tempfile.mkdtemp())
>>> files.write_json(d / files.JOB, {"run_id": "r1", "stage": "canary", "pool": "p", "slots": 2,
...                                  "price_per_slot_hour": 3.0, "launched_at": 100.0})
>>> files.write_supervisor_state(d, files.SupervisorState(attempts=[{"launched_at": 0.0, "ended_at": 60.0}]))
>>> round(total_usd(attempts_in(d, now=160.0)), 4)  # 60 s ended + 60 s running, x 2 slots x $3/h
0.2
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from traingate.cost.ledger import Attempt, Outcome, attempts_of, total_usd
from traingate.job import files


def record(stage_dir: Path, attempts: Sequence[dict[str, Any]], final: bool) -> None:
    """Write the stage's charged attempts (``Attempt.to_record()`` each) into ``charged.json``; ``final``:
    the stage has ended and these are what its StageResult charged."""
    stage_dir = Path(stage_dir)
    state = files.read_supervisor_state(stage_dir)
    files.write_charged(stage_dir, files.Charged(final, list(attempts), len(state.attempts) if state else 0))


def running_since(state: files.SupervisorState | None, job: dict[str, Any]) -> float | None:
    """When the launch running now started, or None when none runs. The supervisor records an attempt in
    supervisor.json only when it ends; the running launch is the one ``job.json`` was written for."""
    if state is None or state.final is not None:
        return None
    recorded = [float(a["launched_at"]) for a in state.attempts if a.get("launched_at") is not None]
    open_ = [
        float(a["launched_at"])
        for a in state.attempts
        if a.get("ended_at") is None and a.get("launched_at") is not None
    ]
    if open_:
        return open_[-1]
    launched = job.get("launched_at")
    return float(launched) if launched is not None and float(launched) > max(recorded, default=0.0) else None


def attempts_in(stage_dir: Path, now: float | None = None) -> list[Attempt]:
    """The stage's attempts so far as the ledger charges them; with ``now``, the running launch up to it."""
    stage_dir = Path(stage_dir)
    state = files.read_supervisor_state(stage_dir)
    charged = files.read_charged(stage_dir)
    job = files.read_json(stage_dir / files.JOB)
    job = job if isinstance(job, dict) else {}
    run_id, stage = str(job.get("run_id") or ""), str(job.get("stage") or stage_dir.name)
    recorded = [Attempt.from_record(run_id, r) for r in charged.attempts] if charged is not None else []
    supervised = state.attempts if state is not None else []
    if (
        charged is not None
        and charged.final
        and (state is None or (state.final is not None and len(supervised) == charged.supervised))
    ):
        return recorded
    if charged is not None and charged.final:
        recorded = []  # a later supervision of the stage: supervisor.json holds the earlier attempts too
    slots, price = int(job.get("slots") or 0), float(job.get("price_per_slot_hour") or 0.0)
    if slots < 1:
        return recorded  # no job.json yet: nothing launched, nothing held
    pool = str(job.get("pool") or "")
    seen = {a.start for a in recorded}
    out = recorded + [a for a in attempts_of(run_id, stage, supervised, pool, slots, price) if a.start not in seen]
    start = running_since(state, job) if now is not None else None
    if start is not None and now is not None:
        # Charged as far as it got; its outcome is not known yet and does not change what it cost.
        out.append(Attempt(run_id, stage, len(out), pool, slots, price, start, max(start, now), Outcome.COMPLETED))
    return out


def stage_usd(stage_dir: Path, now: float | None = None) -> float:
    """What the stage has cost so far (with ``now``: its running launch included)."""
    return total_usd(attempts_in(stage_dir, now))


def run_usd(run_dir: Path, but: str | None = None, now: float | None = None) -> float:
    """The run's spend so far over its stage directories (``but``: leave that stage out)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return 0.0
    return total_usd(
        a
        for d in sorted(run_dir.iterdir())
        if d.is_dir() and d.name != but and ((d / files.SUPERVISOR).exists() or (d / files.CHARGED).exists())
        for a in attempts_in(d, now)
    )
