"""Sweeps on digits: does a trial scheduler buy the same accuracy for less compute?

(a) random search + FIFO, (b) TPE + Hyperband, (c) TPE + ASHA: the same search space,
the same number of trials, fixed seeds (sampler seed and training seed). Trials train
in-process through the runtime's Trainer (traingate.sweep.inprocess), not as
subprocesses, so that 3 x N trials fit on a 2-core machine; pruning hooks into the
trainer's progress callback at the same steps a process's progress.jsonl would report.

Reported: best final val_accuracy, total training steps consumed, and each relative to (a).
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import optuna
import torch

from traingate.spec import load_spec_text
from traingate.sweep.driver import drive
from traingate.sweep.inprocess import run_stage
from traingate.sweep.report import Reporter, TrialOutcome
from traingate.sweep.space import trial_spec

N_TRIALS = int(os.environ.get("TRAINGATE_BENCH_SWEEP_TRIALS", "24"))
MAX_STEPS = 243  # 27 * 3^2: rungs at 27, 81, 243
SPEC = """
identity: {experiment: bench-sweep, owner: bench, team: platform, purpose: compare sweep schedulers}
recipe: {name: digits-cnn, params: {channels: 8, hidden: 32, dropout: 0.1}}
optim: {lr: 0.003, batch_size: 32, seed: 0, warmup_steps: 0, schedule: cosine}
resources: {procs_per_node: 1}
stages: {canary: {max_steps: %d}}
checkpoint: {every_steps: 100000, keep_last: 1, async_save: false}
tracking: {enabled: false}
sweep:
  space:
    optim.lr: {type: float, low: 1.0e-4, high: 0.1, log: true}
    optim.batch_size: {type: categorical, choices: [16, 32, 64]}
    recipe.params.channels: {type: categorical, choices: [4, 8, 16]}
    recipe.params.hidden: {type: categorical, choices: [16, 32, 64]}
    recipe.params.dropout: {type: float, low: 0.0, high: 0.5}
  objectives: [{metric: val_accuracy, direction: maximize}]
  n_trials: %d
  seed: 0
  stage: canary
""" % (MAX_STEPS, N_TRIALS)

CONFIGS = [("random + FIFO", "random", {"name": "fifo", "report_every": 27}),
           ("TPE + Hyperband", "tpe", {"name": "hyperband", "report_every": 27, "min_resource": 27,
                                       "reduction_factor": 3}),
           ("TPE + ASHA", "tpe", {"name": "asha", "report_every": 27, "min_resource": 27, "reduction_factor": 3})]


def run_config(sampler: str, scheduler: dict, work: Path) -> dict:
    from traingate.sweep.algorithms import make_pruner, make_sampler

    base = load_spec_text(SPEC, [f"sweep.sampler={sampler}"])
    base = base.model_copy(update={"sweep": base.sweep.model_copy(update={"scheduler": type(base.sweep.scheduler)
                                                                           .model_validate(scheduler)})})
    sw = base.sweep
    # A fixed study name: Hyperband assigns brackets by hashing it with the trial number.
    study = optuna.create_study(study_name=f"bench-{sampler}-{scheduler['name']}", direction="maximize",
                                sampler=make_sampler(sw), pruner=make_pruner(sw, MAX_STEPS))

    def run_trial(trial: optuna.Trial, params: dict) -> TrialOutcome:
        rep = Reporter(trial, sw)
        t0 = time.time()
        r = run_stage(trial_spec(base, params), "canary", work / f"{sampler}-{scheduler['name']}-{trial.number}",
                      eval_every=sw.scheduler.report_every, on_progress=rep.feed)
        if r["status"] == "stopped":
            return TrialOutcome("pruned", steps=r["steps"], pruned_at_step=rep.pruned_at, start_ts=t0, end_ts=time.time())
        return TrialOutcome("completed", values=[r["metrics"]["val_accuracy"]], steps=r["steps"],
                            start_ts=t0, end_ts=time.time(), metrics=r["metrics"])

    t0 = time.perf_counter()
    res = drive(study, sw, run_trial, poll_s=0.01)
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in res.finished)
    return {"best": study.best_value, "steps": res.steps, "pruned": pruned, "wall_s": time.perf_counter() - t0,
            "trials": len(res.finished), "best_params": study.best_params}


def main() -> str:
    torch.set_num_threads(1)  # what each training process gets (OMP_NUM_THREADS=1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        for label, sampler, scheduler in CONFIGS:
            r = run_config(sampler, scheduler, Path(tmp))
            rows.append((label, r))
            print(f"  {label}: best {r['best']:.4f}, {r['steps']} steps, {r['pruned']} pruned, {r['wall_s']:.0f} s",
                  flush=True)
    base_best, base_steps = rows[0][1]["best"], rows[0][1]["steps"]
    lines = [f"digits-cnn, {N_TRIALS} trials per row, {MAX_STEPS} steps per full trial, sampler seed 0, "
             "training seed 0, trials in-process (1 torch thread)", "",
             "| search + scheduler | best val_accuracy | vs (a) | training steps | vs (a) | pruned | wall s |",
             "|---|---|---|---|---|---|---|"]
    for label, r in rows:
        lines.append(f"| {label} | {r['best']:.4f} | {r['best'] - base_best:+.4f} | {r['steps']} | "
                     f"{r['steps'] / base_steps:.0%} | {r['pruned']}/{r['trials']} | {r['wall_s']:.0f} |")
    goal = [label for label, r in rows[1:] if r["best"] >= base_best - 0.01 and r["steps"] <= 0.4 * base_steps]
    lines += ["", f"goal (within 1% of (a)'s best accuracy with <= 40% of its steps): "
                  f"{'met by ' + ', '.join(goal) if goal else 'NOT met'}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main())
