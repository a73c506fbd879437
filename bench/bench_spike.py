"""The default loss-spike rule on recorded clean runs: its false alarms, and how often it catches a 3x jump.

Clean runs are trained here, in this process (``traingate.sweep.inprocess.run_stage``: the real Trainer
and recipes, no torchrun), one seed each, and their per-step loss read back from metrics.jsonl:

- ``demo``: examples/digits.yaml as the demo runs it (full stage, 150 steps; its 2 ranks' global batch
  of 64 in one process), SEEDS_DEMO seeds;
- ``chargpt``: the char-gpt recipe (defaults, bundled corpus), CHARGPT_STEPS steps, SEEDS_CHARGPT seeds;
- ``tiny``: the test suite's tiny digits spec (lr 0.05, global batch 32) over TINY_STEPS steps: the
  scheduling end-to-end test's jobs, a noisier curve than the demo's.

False alarms: clean runs on which ``alerts.loss_spike`` at its defaults fires at all. Detection: for
every 10th step from 20 on, the same recorded run with its loss x3 from that step on (a jump that stays
up, as the ``spike`` fault's blown-up weights make it); caught when the rule fires at that step or later
and decides within 10 steps (``decided_at``: the step a per-step test acts at). Placements are split by
the loss level at the jump: a 3x jump where the loss has fallen below 5% of its start level gives back
less than 10% of the fall, which the rule treats as noise by design (``min_give_back``).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from traingate.alerts.rules import LossSpikeSpec, loss_spike
from traingate.job import files
from traingate.spec import parse_spec
from traingate.sweep.inprocess import run_stage

ROOT = Path(__file__).resolve().parents[1]
SEEDS_DEMO = 20
SEEDS_CHARGPT = 5
CHARGPT_STEPS = 300
SEEDS_TINY = 10
TINY_STEPS = 400
FACTOR = 3.0
WITHIN = 10
TINY = {
    "identity": {"experiment": "bench", "owner": "bench", "team": "platform", "purpose": "record clean loss curves"},
    "recipe": {"name": "digits-cnn", "params": {"channels": 8, "hidden": 32}},
    "optim": {"lr": 0.05, "batch_size": 32},
    "resources": {"work_pool": "cpu-local"},
}


def _tree(kind: str, seed: int) -> dict[str, Any]:
    if kind == "demo":
        t = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
        t["optim"]["batch_size"] *= t["resources"]["procs_per_node"]  # the logged loss is the global batch's
        steps = t["stages"]["full"]["max_steps"]
    elif kind == "chargpt":
        t = yaml.safe_load(yaml.safe_dump(TINY))
        t["recipe"] = {"name": "char-gpt"}
        t["optim"] = {"lr": 0.003, "batch_size": 32, "warmup_steps": 20, "schedule": "cosine"}
        steps = CHARGPT_STEPS
    else:
        t = yaml.safe_load(yaml.safe_dump(TINY))
        steps = TINY_STEPS
    t["optim"]["seed"] = seed
    t["resources"]["procs_per_node"] = 1
    t["stages"] = {"full": {"max_steps": steps}}
    t["gates"] = {}
    t["tracking"] = {"enabled": False}
    t["checkpoint"] = {"every_steps": steps}
    t["alerts"] = {"loss_spike": {"enabled": False}}  # recorded clean: the rule is applied afterwards
    return t


def record(kind: str, seed: int, work: Path) -> list[tuple[int, float]]:
    """One clean run's per-step training loss."""
    out = work / f"{kind}{seed}"
    result = run_stage(parse_spec(_tree(kind, seed)), "full", out)
    assert result["status"] == "completed", result
    return [(m.step, m.loss) for m in sorted(files.read_metrics(out), key=lambda m: m.step)]


def score(curves: list[list[tuple[int, float]]], spec: LossSpikeSpec) -> dict[str, Any]:
    """False alarms on the clean curves; 3x jumps caught within WITHIN steps, by loss level."""
    false_alarms = [f for f in (loss_spike(c, spec) for c in curves) if f is not None]
    caught = {"above": [0, 0], "below": [0, 0]}
    delays: list[float] = []
    for c in curves:
        start = statistics.median(v for _, v in c[: spec.min_points])
        for i in range(20, len(c) - 15, 10):
            at, level = c[i]
            band = caught["above" if level >= 0.05 * start else "below"]
            band[1] += 1
            f = loss_spike([(s, v * FACTOR if s >= at else v) for s, v in c], spec)
            if f is not None and at <= f.at and f.values["decided_at"] < at + WITHIN:
                band[0] += 1
                delays.append(f.values["decided_at"] - at)
    return {"runs": len(curves), "false_alarms": false_alarms, "caught": caught, "delays": delays}


def _ratio(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.0f}%)" if d else "-"


def main() -> str:
    torch.set_num_threads(1)  # many short runs: one thread each is faster on a shared machine
    spec = LossSpikeSpec()
    rows = [
        f"Default rule: median of the latest {spec.steps} points >= {spec.ratio:g}x the median of the "
        f"{spec.window} before and giving back >= {100 * spec.min_give_back:g}% of the fall from the start level.",
        "",
        f"| recipe (runs x steps) | clean runs with a false alarm | 3x jump caught within {WITHIN} steps: "
        "loss >= 5% of start | loss < 5% of start | steps to decide (mean, max) |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="tg-bench-spike-") as tmp:
        for kind, seeds in (("demo", SEEDS_DEMO), ("chargpt", SEEDS_CHARGPT), ("tiny", SEEDS_TINY)):
            curves = [record(kind, seed, Path(tmp)) for seed in range(seeds)]
            r = score(curves, spec)
            d = r["delays"]
            fa = ", ".join(f"step {f.at:g}" for f in r["false_alarms"])
            rows.append(
                f"| {kind} ({len(curves)} x {len(curves[0])}) | {_ratio(len(r['false_alarms']), len(curves))}"
                f"{f' ({fa})' if fa else ''} | {_ratio(*r['caught']['above'])} | {_ratio(*r['caught']['below'])} | "
                + (f"{sum(d) / len(d):.1f}, {max(d):g} |" if d else "- |")
            )
    return "\n".join(rows)


if __name__ == "__main__":
    print(main())
