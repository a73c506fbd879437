"""The ``script`` recipe: an existing training command, run unmodified, read through its output.

Metrics come from named-group regexes declared in the spec; a group named ``step``
gives the step, every other named group is a metric.

>>> series = extract_metrics("step 1 loss=2.5\\nstep 2 loss=1.5\\n", [r"step (?P<step>\\d+) loss=(?P<loss>\\S+)"])
>>> series["loss"]
[(1, 2.5), (2, 1.5)]
>>> summarize(series)["loss_decrease_fraction"]
0.4
"""
from __future__ import annotations

import math
import re

from traingate.spec import RunSpec

PYTHONS = ("python", "python3")


def build_command(spec: RunSpec, stage: str, python: str, nproc: int, nnodes: int = 1,
                  rdzv_endpoint: str | None = None) -> list[str]:
    """The command line for one stage of a script recipe (stage args appended)."""
    s = spec.recipe.script
    assert s is not None
    cmd = [*s.command, *s.stage_args.get(stage, [])]
    if s.launcher == "torchrun":
        if cmd[0] not in PYTHONS:
            raise ValueError(f"recipe.script.command = {s.command!r}: launcher torchrun needs a python command "
                             "('python train.py ...' or 'python -m pkg'); use launcher: plain otherwise")
        return [python, "-m", "torch.distributed.run", *torchrun_args(nproc, nnodes, rdzv_endpoint), *cmd[1:]]
    if cmd[0] in PYTHONS:
        cmd[0] = python  # the environment traingate runs in, not whatever `python` is on PATH
    return cmd


def torchrun_args(nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None) -> list[str]:
    if nnodes > 1:
        assert rdzv_endpoint, "validated by ResourcesSpec"
        return [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}"]
    return ["--standalone", f"--nproc_per_node={nproc}"]


def extract_metrics(text: str, patterns: list[str]) -> dict[str, list[tuple[int, float]]]:
    """All (step, value) pairs each named group matched, in output order.

    Lines without a ``step`` group get a running index per metric.
    """
    compiled = [re.compile(p) for p in patterns]
    series: dict[str, list[tuple[int, float]]] = {}
    for line in text.splitlines():
        for rx in compiled:
            for m in rx.finditer(line):
                groups = m.groupdict()
                step = groups.pop("step", None)
                for name, raw in groups.items():
                    if raw is None:
                        continue
                    try:
                        value = float(raw)
                    except ValueError:
                        continue
                    seq = series.setdefault(name, [])
                    seq.append((int(step) if step is not None else len(seq), value))
    return series


def summarize(series: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """Gate-ready numbers: each metric's final/first/min/max; for *loss*: decrease and non-finite count."""
    out: dict[str, float] = {}
    nonfinite = 0
    steps = 0
    for name, points in series.items():
        values = [v for _, v in points]
        finite = [v for v in values if math.isfinite(v)]
        steps = max(steps, max(s for s, _ in points))
        if "loss" in name:
            nonfinite += len(values) - len(finite)
        if not finite:
            continue
        out[name] = finite[-1]
        out[f"{name}_first"] = finite[0]
        out[f"{name}_min"] = min(finite)
        out[f"{name}_max"] = max(finite)
    loss_key = "loss" if "loss" in out else ("train_loss" if "train_loss" in out else None)
    if loss_key:
        k = max(1, min(5, len(series[loss_key]) // 4))
        vals = [v for _, v in series[loss_key] if math.isfinite(v)]
        first, last = sum(vals[:k]) / k, sum(vals[-k:]) / k
        out["loss_decrease_fraction"] = (first - last) / first if first > 0 else 0.0
    out["nonfinite_steps"] = float(nonfinite)
    out["steps"] = float(steps)
    return out
