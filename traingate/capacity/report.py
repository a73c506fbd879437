"""What a replay comparison prints and writes: markdown tables, plots (matplotlib Agg), and each
policy's schedule as CSV."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from traingate.capacity.policy import Policy
from traingate.capacity.simulate import SimResult, summarize

# The comparison `traingate simulate` runs by default: each order, backfill on the fair-share
# order (the platform's default), each with and without preemption.
COMPARED = tuple(
    p + m for p in ("fifo", "priority", "sjf", "fairshare", "fairshare+backfill") for m in ("", "+preempt")
)


def _unit(seconds: Sequence[float]) -> tuple[str, float]:
    top = max(seconds, default=0.0)
    return ("h", 3600.0) if top >= 3 * 3600 else ("min", 60.0) if top >= 180 else ("s", 1.0)


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}" if base > 0 else "n/a"


def baseline(results: Sequence[SimResult]) -> SimResult:
    """FIFO without preemption when it was run, else the first policy."""
    return next((r for r in results if r.policy.name == "fifo"), results[0])


def _name(res: SimResult, default: Policy | None) -> str:
    return res.policy.name + (" (config default)" if res.policy == default else "")


def table(results: Sequence[SimResult], default: Policy | None = None) -> str:
    ms = [summarize(r) for r in results]
    base = summarize(baseline(results))
    unit, div = _unit([m.mean_jct_s for m in ms])
    lines = [
        f"| policy | mean wait ({unit}) | p95 wait ({unit}) | mean JCT ({unit}) | wait / FIFO | JCT / FIFO "
        f"| utilisation | fragmented GPUs | preemptions | GPU-h lost | replay (jobs per CPU-s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, m in zip(results, ms):
        lines.append(
            f"| {_name(r, default)} | {m.mean_wait_s / div:.2f} | {m.p95_wait_s / div:.2f} | {m.mean_jct_s / div:.2f} "
            f"| {_ratio(m.mean_wait_s, base.mean_wait_s)} | {_ratio(m.mean_jct_s, base.mean_jct_s)} "
            f"| {m.utilisation:.1%} | {m.fragmented_gpus:.2f} ({m.fragmented_frac:.1%}) | {m.preemptions} "
            f"| {m.wasted_gpu_h:.1f} | {m.jobs / r.cpu_s:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def by_class_table(results: Sequence[SimResult]) -> str:
    ms = [summarize(r) for r in results]
    classes = sorted({c for m in ms for c in m.wait_by_class})
    unit, div = _unit([w for m in ms for w in m.wait_by_class.values()])
    lines = [
        "| policy | " + " | ".join(f"{c} mean wait ({unit})" for c in classes) + " |",
        "|---" * (len(classes) + 1) + "|",
    ]
    for r, m in zip(results, ms):
        lines.append(
            f"| {r.policy.name} | "
            + " | ".join(f"{m.wait_by_class[c] / div:.2f}" if c in m.wait_by_class else "-" for c in classes)
            + " |"
        )
    return "\n".join(lines) + "\n"


def by_team_table(results: Sequence[SimResult]) -> str:
    ms = [summarize(r) for r in results]
    teams = sorted({t for m in ms for t in m.wait_by_team})
    unit, div = _unit([w for m in ms for w in m.wait_by_team.values()])
    lines = [
        "| policy | " + " | ".join(f"{t}: GPU share, mean wait ({unit})" for t in teams) + " |",
        "|---" * (len(teams) + 1) + "|",
    ]
    for r, m in zip(results, ms):
        lines.append(
            f"| {r.policy.name} | "
            + " | ".join(
                f"{m.share_by_team.get(t, 0.0):.1%}, {m.wait_by_team[t] / div:.2f}" if t in m.wait_by_team else "-"
                for t in teams
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def report(results: Sequence[SimResult], title: str, default: Policy | None = None) -> str:
    """``default``: the policy the config's ``scheduling`` section names, marked in the table."""
    r0 = results[0]
    return (
        f"{title}\n\nfair-share half-life {r0.half_life_h:g} h; ratios against "
        f"{baseline(results).policy.name}; JCT = job completion time (submission to end)\n\n"
        f"{table(results, default)}\nMean queueing delay by priority class:\n\n{by_class_table(results)}\n"
        f"GPU-hours held and mean queueing delay by team:\n\n{by_team_table(results)}"
    )


def write_schedule(res: SimResult, path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "job_id",
                "team",
                "priority",
                "pool",
                "gpus",
                "submit_s",
                "first_start_s",
                "end_s",
                "wait_s",
                "preemptions",
                "attempts (start-end@nodes:how)",
            ]
        )
        for r in res.records:
            w.writerow(
                [
                    r.job_id,
                    r.team,
                    r.priority,
                    r.pool,
                    r.slots,
                    r.submit_s,
                    r.first_start_s,
                    r.end_s,
                    r.wait_s,
                    r.preemptions,
                    ";".join(
                        f"{s:g}-{e:g}@{'+'.join(map(str, nodes))}:{how}"
                        for (s, nodes, how), e in zip(r.attempts, r.preempted_at + [r.end_s])
                    ),
                ]
            )
    return path


def plots(results: Sequence[SimResult], out: Path) -> list[Path]:
    # lazy: matplotlib takes a second to import; only `traingate simulate` draws (a Figure needs no display)
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    ms = [summarize(r) for r in results]
    names = [r.policy.name for r in results]
    paths = []

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for r, name in zip(results, names):
        w = np.sort([rec.wait_s / 3600.0 for rec in r.records])
        ax.step(
            np.maximum(w, 1e-3),
            np.arange(1, len(w) + 1) / len(w),
            where="post",
            label=name,
            linestyle="--" if r.policy.preempt else "-",
        )
    ax.set_xscale("log")
    ax.set_xlabel("queueing delay (h, log; 0 shown at 0.001)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("Queueing delay CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "wait_cdf.png")
    fig.savefig(paths[-1], dpi=110)

    base = summarize(baseline(results))
    fig = Figure(figsize=(9, 4.5))
    ax = fig.add_subplot()
    x = np.arange(len(names))
    ax.bar(x - 0.2, [m.mean_wait_s / base.mean_wait_s if base.mean_wait_s else 0 for m in ms], 0.4, label="mean wait")
    ax.bar(x + 0.2, [m.mean_jct_s / base.mean_jct_s if base.mean_jct_s else 0 for m in ms], 0.4, label="mean JCT")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(f"ratio to {baseline(results).policy.name}")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "ratios.png")
    fig.savefig(paths[-1], dpi=110)

    teams = sorted({t for m in ms for t in m.share_by_team})
    fig = Figure(figsize=(9, 4.5))
    ax = fig.add_subplot()
    bottom = np.zeros(len(names))
    for t in teams:
        share = np.array([m.share_by_team.get(t, 0.0) for m in ms])
        ax.bar(x, share, 0.6, bottom=bottom, label=t)
        bottom += share
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("share of GPU-hours held")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "team_share.png")
    fig.savefig(paths[-1], dpi=110)
    return paths
