"""Monitoring: its cost on step time, and the time from a loss spike to the completed roll-back.

The digits example spec (2 ranks, torchrun, gloo, CPU) under the real supervisor. Overhead: the
same full stage with ``alerts.enabled`` true (rank 0 writes metrics.jsonl each step, every rank its
busy times in its heartbeat, the supervisor evaluates the 14 rules every second) and false,
alternated, REPEATS runs each; the mean step time of each run is rank 0's own (result.json's
profile), so the supervisor's start-up does not count. Roll-back: a spike injected at step 63
(``spike@62``) and the default ``loss_spike`` rule; from the spike's metrics line (its step's end)
to the supervisor's decision (the alert line), to the relaunch and to the first step after it.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from traingate.job import files
from traingate.job.stagejob import JobKind, derive
from traingate.job.vocab import Status
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision.supervisor import supervise

ROOT = Path(__file__).resolve().parents[1]
STEPS = 300
REPEATS = 3
SPIKE_AT = 62


def _job(work: Path, name: str, *overrides: str, faults: str | None = None):
    spec = load_spec(ROOT / "examples" / "digits.yaml", [
        f"stages.full.max_steps={STEPS}", "checkpoint.every_steps=20", "tracking.enabled=false", *overrides])
    stage_dir = work / name
    return derive(spec, "full", run_id=f"bench-{name}", run_dir=work, settings=Settings.from_env(),
                  kind=JobKind.DRILL, stage_dir=stage_dir, checkpoint_uri=(stage_dir / "checkpoints").as_uri(),
                  faults=faults)


def _step_mean(work: Path, name: str, alerts: bool) -> float:
    job = _job(work, name, f"alerts.enabled={str(alerts).lower()}")
    sup = supervise(job, seed=0)
    assert sup.status == Status.COMPLETED, sup.error
    profile = files.read_result(Path(job.stage_dir)).metrics["profile"]
    return float(profile["step_time_mean_s"])


def main() -> str:
    with tempfile.TemporaryDirectory(prefix="tg-bench-monitor-") as tmp:
        work = Path(tmp)
        on, off = [], []
        for i in range(REPEATS):
            off.append(_step_mean(work, f"off{i}", alerts=False))
            on.append(_step_mean(work, f"on{i}", alerts=True))
        # faults "slow" would pace the run; the spike alone: the digits steps are ~10 ms.
        job = _job(work, "spike", faults=f"spike@{SPIKE_AT}")
        sup = supervise(job, seed=0)
        assert sup.status == Status.COMPLETED, sup.error
        stage_dir = Path(job.stage_dir)
        spike = next(m for m in files.read_metrics(stage_dir) if m.attempt == 0 and m.step == SPIKE_AT + 1)
        alert = files.read_alerts(stage_dir)[0]
        relaunch = sup.attempts[1]
    mean_on, mean_off = statistics.mean(on), statistics.mean(off)
    rows = [
        "| monitoring | mean step (ms), per run | mean | vs off |",
        "|---|---|---|---|",
        f"| alerts off | {', '.join(f'{x * 1e3:.2f}' for x in off)} | {mean_off * 1e3:.2f} | 1.000x |",
        f"| alerts on | {', '.join(f'{x * 1e3:.2f}' for x in on)} | {mean_on * 1e3:.2f} | {mean_on / mean_off:.3f}x |",
        "",
        f"| spike at step {SPIKE_AT + 1} ({alert.rule}) | seconds after the spike's step |",
        "|---|---|",
        f"| alert raised, roll-back ordered | {alert.time - spike.time:.2f} |",
        f"| relaunch from step {sup.job.rollbacks[0].to_step} | {relaunch.launched_at - spike.time:.2f} |",
        f"| first step after the roll-back | {(relaunch.first_step_time or float('nan')) - spike.time:.2f} |",
        f"| steps trained past the spike before the kill | {sup.attempts[0].end_step - (SPIKE_AT + 1)} |",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    print(main())
