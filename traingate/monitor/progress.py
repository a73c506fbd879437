"""One training stage's progress in words and a percentage, for the Prefect UI's progress artifact.

Read from the same :class:`traingate.monitor.dashboard.Snapshot` that ``traingate watch`` and the
terminal bar draw, so the UI, the watch view and the terminal agree on steps, loss and ETA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from traingate.monitor.dashboard import Snapshot, duration, usd


@dataclass(frozen=True)
class StageProgress:
    percent: float  # 0-100, what a progress artifact holds
    text: str  # one markdown paragraph: stage, steps done of total, latest loss, ETA, spend; then the link


def stage_progress(snap: Snapshot, stage: str, link: str = "") -> StageProgress:
    """``stage`` as ``snap`` shows it; a stage the snapshot does not show yet is waiting to start.

    >>> from traingate.monitor.dashboard import StageLine
    >>> snap = Snapshot("r1", 100.0, (StageLine("canary", "running", 12, 16),), "canary", "running", 12, 16,
    ...                 eta_s=3.2, loss=(0.61, 0.4123), spent_usd=0.0012)
    >>> p = stage_progress(snap, "canary", "MLflow run: [ab12](http://mlflow/#/runs/ab12)")
    >>> p.percent, p.text.splitlines()[0]
    (75.0, '**canary** running: step 12/16 (75%), loss 0.4123, ETA 0:03, run $0.0012 so far')
    >>> stage_progress(snap, "full").text
    '**full** waiting to start'
    """
    if snap.stage != stage:
        body = f"**{stage}** waiting to start"
        return StageProgress(0.0, f"{body}\n\n{link}" if link else body)
    parts = [f"step {snap.step}/{snap.max_steps or '?'} ({snap.fraction:.0%})"]
    if snap.loss:
        loss = snap.loss[-1]
        parts.append(f"loss {loss:.4g}" if math.isfinite(loss) else f"loss {loss}")
    if snap.status == "running":
        parts.append(f"ETA {duration(snap.eta_s)}")
    parts.append(f"run {usd(snap.spent_usd)} so far")
    body = f"**{stage}** {snap.status}: {', '.join(parts)}"
    return StageProgress(round(100.0 * snap.fraction, 1), f"{body}\n\n{link}" if link else body)
