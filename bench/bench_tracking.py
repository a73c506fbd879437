"""Tracking overhead: step time with full tracking vs. tracking disabled, digits recipe, same invocation.

Both arms run the same training process (``examples/digits.yaml``, its full stage's model
and batch, one process, tracking.log_every 10); "full tracking" writes into a real MLflow
run on SQLite: metrics through the journal and the background writer, per-rank system
signals, restart bookkeeping. "Disabled" is ``tracking.enabled=false``. The arms alternate
(A B A B ...) so drift in machine load hits both; the step time is the runtime's own
``step_time_mean_s`` (training steps only, no startup), compared by median over repeats.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "digits.yaml"
STEPS = 2000
REPEATS = 4
LOG_EVERY = 10


def _run(work: Path, tracking: bool, i: int, tracking_uri: str) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    import dataclasses
    import time

    from traingate.job.stagejob import derive
    from traingate.settings import Settings
    from traingate.spec import load_spec

    name = f"{'on' if tracking else 'off'}-{i}"
    spec = load_spec(SPEC, [f"stages.full.max_steps={STEPS}", f"tracking.enabled={str(tracking).lower()}",
                            f"tracking.log_every={LOG_EVERY}", "checkpoint.every_steps=1000000",
                            "resources.procs_per_node=1"])
    run_id = None
    if tracking:
        c = MlflowClient(tracking_uri)
        exp = c.get_experiment_by_name("bench-tracking") or c.get_experiment(
            c.create_experiment("bench-tracking", artifact_location=(work / "mlartifacts").as_uri()))
        run_id = c.create_run(exp.experiment_id, run_name=name).info.run_id
    job = derive(spec, "full", run_id=name, run_dir=work, settings=Settings.from_env(),
                 checkpoint_uri=(work / name / "checkpoints").as_uri())
    job = dataclasses.replace(job.launch(time.time()), tracking_uri=tracking_uri if tracking else None,
                              mlflow_run_id=run_id)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_RUN_ID", None)
    subprocess.run([sys.executable, "-m", "traingate.runtime.train", "--job", str(job.write())],
                   env=env, cwd=work, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prof = json.loads((work / name / "result.json").read_text())["metrics"]["profile"]
    out = {"mean": prof["step_time_mean_s"], "p50": prof["step_time_p50_s"]}
    if tracking:
        hist = MlflowClient(tracking_uri).get_metric_history(run_id, "train_loss")
        assert len(hist) == STEPS // LOG_EVERY, "tracking lost metrics"
    return out


def _costs(work: Path) -> dict[str, float]:
    """Load-independent view: CPU the tracker spends per logging step, in this process."""
    import time

    from mlflow.tracking import MlflowClient

    from traingate.tracking.system import SystemSignals
    from traingate.tracking.tracker import MlflowTracker

    uri = f"sqlite:///{work}/costs.db"
    c = MlflowClient(uri)
    run_id = c.create_run(c.create_experiment("costs", artifact_location=(work / "mlartifacts").as_uri())).info.run_id
    tracker = MlflowTracker(uri, run_id, work / "costs")
    signals = SystemSignals(0, 1, True)
    n = 500
    t0 = time.thread_time()
    for step in range(1, n + 1):
        metrics = {k: 0.5 for k in ("train_loss", "lr", "grad_norm", "step_time_s", "samples_per_s",
                                    "tokens_per_s", "data_wait_s")}
        tracker.log_metrics({**metrics, **signals.collect(0.01)}, step)
    caller_us = (time.thread_time() - t0) / n * 1e6
    per_step_metrics = len(metrics) + len(signals.collect(0.01))
    tracker.close()
    t0 = time.process_time()
    from mlflow.entities import Metric

    batch = [Metric(f"k{i % per_step_metrics}", 0.5, 0, 10_000 + i // per_step_metrics) for i in range(990)]
    c.log_batch(run_id, metrics=batch)
    deliver_us = (time.process_time() - t0) / len(batch) * 1e6 * per_step_metrics
    return {"caller_us": caller_us, "deliver_us": deliver_us, "metrics": per_step_metrics}


def main() -> str:
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        work = Path(tmp)
        uri = f"sqlite:///{work}/mlflow.db"
        on: list[dict[str, float]] = []
        off: list[dict[str, float]] = []
        _run(work, True, -1, uri)  # warm the page cache and migrate the store; not counted
        for i in range(REPEATS):
            off.append(_run(work, False, i, uri))
            on.append(_run(work, True, i, uri))
        costs = _costs(work)
    rows = ["| step time (ms) | tracking disabled | full tracking | overhead |", "|---|---|---|---|"]
    for key, label in (("mean", "mean"), ("p50", "p50")):
        a = statistics.median(r[key] for r in off)
        b = statistics.median(r[key] for r in on)
        rows.append(f"| {label} (median of {REPEATS}) | {a * 1e3:.3f} | {b * 1e3:.3f} | {100 * (b - a) / a:+.1f}% |")
    spread = [100 * (r_on["mean"] - r_off["mean"]) / r_off["mean"] for r_on, r_off in zip(on, off)]
    rows.append(f"| paired overhead per repeat (mean) | | | {', '.join(f'{s:+.1f}%' for s in spread)} |")
    step_ms = statistics.median(r["mean"] for r in off) * 1e3
    per_log = costs["caller_us"] + costs["deliver_us"]
    rows += ["", "| CPU per logging step ({:d} metrics) | µs | % of a {:.2f} ms step at log_every {:d} |".format(
        costs["metrics"], step_ms, LOG_EVERY), "|---|---|---|",
        f"| training thread (journal append + system signals) | {costs['caller_us']:.0f} | "
        f"{100 * costs['caller_us'] / 1e3 / LOG_EVERY / step_ms:.2f}% |",
        f"| writer thread (log_batch into SQLite, same process) | {costs['deliver_us']:.0f} | "
        f"{100 * costs['deliver_us'] / 1e3 / LOG_EVERY / step_ms:.2f}% |",
        f"| total | {per_log:.0f} | {100 * per_log / 1e3 / LOG_EVERY / step_ms:.2f}% |"]
    return "\n".join(rows) + "\n" + \
        f"\ndigits-cnn ({SPEC.name} model, batch 32), {STEPS} steps, 1 process, log_every {LOG_EVERY}; goal <= 2%.\n"
