"""What a replay comparison prints and writes: markdown tables, plots (matplotlib Agg), and each
policy's schedule as CSV."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from traingate.capacity.figures import BSLD_BOUND_S, SIZE_BUCKETS, Figures, Interval, Waits, figures, timeseries
from traingate.capacity.fill import FillCurve
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
        f"| utilisation | fragmented GPUs | preemptions (stops / preemptive starts) | GPU-h lost "
        f"| replay (jobs per CPU-s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, m in zip(results, ms):
        lines.append(
            f"| {_name(r, default)} | {m.mean_wait_s / div:.2f} | {m.p95_wait_s / div:.2f} | {m.mean_jct_s / div:.2f} "
            f"| {_ratio(m.mean_wait_s, base.mean_wait_s)} | {_ratio(m.mean_jct_s, base.mean_jct_s)} "
            f"| {m.utilisation:.1%} | {m.fragmented_gpus:.2f} ({m.fragmented_frac:.1%}) "
            f"| {m.preemptions} / {sum(a[2] == 'preemption' for rec in r.records for a in rec.attempts)} "
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


def pools_table(results: Sequence[SimResult], figs: Sequence[Sequence[Figures]]) -> str:
    """Per pool (and over all pools when there are several): wait percentiles, bounded slowdown,
    makespan, utilisation, preemptions and GPU-hours they lost."""
    rows = [(r, f) for r, fs in zip(results, figs) for f in (fs if len(fs) > 2 else fs[:1])]
    unit, div = _unit([f.waits.max_s for _, f in rows])
    munit, mdiv = _unit([f.makespan_s for _, f in rows])
    lines = [
        f"| policy | pool | jobs | GPUs | p50 wait ({unit}) | p95 wait ({unit}) | p99 wait ({unit}) "
        f"| max wait ({unit}) | bounded slowdown mean / p95 / max | makespan ({munit}) | utilisation "
        f"| preemptions (stops) | preemptive starts | GPU-h lost to preemption | limit stops | GPU-h lost at limits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, f in rows:
        w = f.waits
        lines.append(
            f"| {r.policy.name} | {f.scope} | {f.jobs} | {f.capacity} | {w.p50_s / div:.2f} | {w.p95_s / div:.2f} "
            f"| {w.p99_s / div:.2f} | {w.max_s / div:.2f} | {f.bsld_mean:.2f} / {f.bsld_p95:.2f} / {f.bsld_max:.2f} "
            f"| {f.makespan_s / mdiv:.2f} | {f.utilisation:.1%} | {f.preemptions} | {f.preemptive_starts} "
            f"| {f.lost_gpu_h:.2f} | {f.limit_stops} | {f.lost_limit_gpu_h:.2f} |"
        )
    return "\n".join(lines) + "\n"


def by_size_table(results: Sequence[SimResult], figs: Sequence[Sequence[Figures]]) -> str:
    """Over all pools: per GPU-count bucket, jobs and mean / p95 wait."""
    totals = [fs[-1] for fs in figs]
    buckets = [name for _, name in SIZE_BUCKETS if any(name in f.waits_by_size for f in totals)]
    unit, div = _unit([w.p95_s for f in totals for w in f.waits_by_size.values()])
    lines = [
        "| policy | "
        + " | ".join(f"{b} GPU{'s' if b not in ('1', '<1') else ''}: jobs, mean / p95 wait ({unit})" for b in buckets)
        + " |",
        "|---" * (len(buckets) + 1) + "|",
    ]
    for r, f in zip(results, totals):
        cells = []
        for b in buckets:
            w = f.waits_by_size.get(b)
            cells.append(f"{w.jobs}, {w.mean_s / div:.2f} / {w.p95_s / div:.2f}" if w else "-")
        lines.append(f"| {r.policy.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(
    results: Sequence[SimResult],
    title: str,
    default: Policy | None = None,
    figs: Sequence[Sequence[Figures]] | None = None,
) -> str:
    """``default``: the policy the config's ``scheduling`` section names, marked in the table;
    ``figs``: each result's :func:`figures` when already computed."""
    r0 = results[0]
    figs = figs if figs is not None else [figures(r) for r in results]
    return (
        f"{title}\n\nfair-share half-life {r0.half_life_h:g} h; ratios against "
        f"{baseline(results).policy.name}; JCT = job completion time (submission to end)\n\n"
        f"{table(results, default)}\nMean queueing delay by priority class:\n\n{by_class_table(results)}\n"
        f"GPU-hours held and mean queueing delay by team:\n\n{by_team_table(results)}\n"
        f"Per pool: queueing delay percentiles, bounded slowdown (max(1, (end - submit) / max(work, "
        f"{BSLD_BOUND_S:g} s))), makespan (first submission to last end), utilisation while jobs arrive, "
        f"every job stopped by a preemption and every start the preemption rule made, backfilled attempts "
        f"stopped at their limit:\n\n"
        f"{pools_table(results, figs)}\nQueueing delay by job size (GPUs asked), all pools:\n\n"
        f"{by_size_table(results, figs)}"
    )


FIGURE_COLUMNS = (
    "policy,pool,jobs,capacity_gpus,wait_mean_s,wait_p50_s,wait_p95_s,wait_p99_s,wait_max_s,bsld_mean,bsld_p95,"
    "bsld_max,makespan_s,asked_gpu_h,held_gpu_h,utilisation,preemptions,preemptive_starts,lost_gpu_h,limit_stops,"
    "lost_limit_gpu_h"
).split(",")
SIZE_COLUMNS = "policy,pool,gpus,jobs,wait_mean_s,wait_p50_s,wait_p95_s,wait_p99_s,wait_max_s".split(",")


def _waits_cells(w: Waits) -> list[str]:
    return [str(w.jobs), *(_num(x) for x in (w.mean_s, w.p50_s, w.p95_s, w.p99_s, w.max_s))]


def write_figures(results: Sequence[SimResult], figs: Sequence[Sequence[Figures]], out: Path) -> list[Path]:
    """``figures.csv`` (one row per policy and pool, ``all`` for every pool together) and
    ``waits_by_size.csv`` (one row per policy, pool and GPU-count bucket), every digit kept."""
    paths = [out / "figures.csv", out / "waits_by_size.csv"]
    with paths[0].open("w", newline="") as f0, paths[1].open("w", newline="") as f1:
        w0, w1 = csv.writer(f0), csv.writer(f1)
        w0.writerow(FIGURE_COLUMNS)
        w1.writerow(SIZE_COLUMNS)
        for r, fs in zip(results, figs):
            for g in fs:
                w = _waits_cells(g.waits)
                w0.writerow(
                    [r.policy.name, g.scope, w[0], g.capacity, *w[1:]]
                    + [
                        _num(x)
                        for x in (g.bsld_mean, g.bsld_p95, g.bsld_max, g.makespan_s, g.asked_gpu_h, g.held_gpu_h)
                    ]
                    + [_num(g.utilisation), g.preemptions, g.preemptive_starts, _num(g.lost_gpu_h)]
                    + [g.limit_stops, _num(g.lost_limit_gpu_h)]
                )
                for bucket, ws in g.waits_by_size.items():
                    w1.writerow([r.policy.name, g.scope, bucket, *_waits_cells(ws)])
    return paths


SERIES_COLUMNS = "pool,start_s,end_s,queued_mean,queued_max,running_mean,busy_gpus_mean,capacity_gpus,utilisation"


def write_timeseries(series: Sequence[Interval], path: Path) -> Path:
    """One row per pool and interval (``all``: every pool together), every digit kept."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SERIES_COLUMNS.split(","))
        for i in series:
            w.writerow(
                [i.scope, _num(i.start_s), _num(i.end_s), _num(i.queued_mean), i.queued_max, _num(i.running_mean)]
                + [_num(i.busy_gpus_mean), i.capacity, _num(i.utilisation)]
            )
    return path


def _num(x: float | None, whole: Literal["0", "-"] = "0") -> str:
    """Every digit: the shortest text that reads back as the same float, never in exponent form
    (``1e-07`` would clash with the ``start-end`` of an attempt). ``whole="-"`` writes 100.0 as 100."""
    return "" if x is None else np.format_float_positional(float(x), trim=whole)


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
                "limit_stops",
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
                    _num(r.submit_s),
                    _num(r.first_start_s),
                    _num(r.end_s),
                    _num(r.wait_s),
                    r.preemptions,
                    len(r.limit_stops),
                    ";".join(
                        f"{_num(s, '-')}-{_num(e, '-')}@{'+'.join(map(str, nodes))}:{how}"
                        for (s, nodes, how), e in zip(r.attempts, r.preempted_at + [r.end_s])
                    ),
                ]
            )
    return path


def _matplotlib() -> Any:
    """matplotlib's ``figure`` and ``colormaps`` (a Figure needs no display)."""
    # lazy: matplotlib takes a second to import; only `traingate simulate` draws
    import matplotlib.figure

    return matplotlib


def _colours(n: int) -> list[tuple[float, ...]]:
    """``n`` distinct colours: tab10, tab20 past ten, evenly spaced along ``turbo`` past twenty."""
    colormaps = _matplotlib().colormaps
    if n > 20:
        return [colormaps["turbo"](k / (n - 1)) for k in range(n)]
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(k) for k in range(n)]


PLOT_POINTS = 200


def _timeseries_figure(results: Sequence[SimResult], series: Sequence[Sequence[Interval]]) -> Any:
    """Queue length and utilisation over time: a row per pool (and one over all pools when there
    are several), a line per policy."""
    Figure = _matplotlib().figure.Figure

    scopes = list(dict.fromkeys(i.scope for s in series for i in s))
    if len(scopes) == 2:
        scopes = scopes[:1]  # one pool: "all" is the same
    t0 = min((s[0].start_s for s in series if s), default=0.0)
    unit, div = _unit([i.end_s - t0 for s in series for i in s[-1:]])
    colours = _colours(len(results))
    fig = Figure(figsize=(11, 2.6 * len(scopes) + 0.8))
    axes = fig.subplots(len(scopes), 2, squeeze=False, sharex=True)
    width = 0.0
    for row, scope in enumerate(scopes):
        qax, uax = axes[row]
        for r, s, colour in zip(results, series, colours):
            mine = [i for i in s if i.scope == scope]
            # At most PLOT_POINTS points: the mean of k equal intervals is the mean over their union.
            group = np.arange(len(mine)) // max(1, -(-len(mine) // PLOT_POINTS))
            n = np.bincount(group)

            def mean(xs: list[float], g: np.ndarray = group, n: np.ndarray = n) -> np.ndarray:
                return np.bincount(g, weights=xs) / n

            x = (mean([(i.start_s + i.end_s) / 2 for i in mine]) - t0) / div
            width = (mine[0].end_s - mine[0].start_s) * n[0] / div if mine else 0.0
            style = "--" if r.policy.preempt else "-"
            qax.plot(x, mean([i.queued_mean for i in mine]), style, color=colour, label=r.policy.name)
            uax.plot(x, 100 * mean([i.utilisation for i in mine]), style, color=colour, label=r.policy.name)
        cap = next((i.capacity for s in series for i in s if i.scope == scope), 0)
        qax.set_ylabel("queued jobs (jobs)")
        qax.set_title(f"{scope}: queue length (mean per {width:.3g} {unit})", fontsize=9)
        uax.set_ylabel("utilisation (% of GPUs)")
        uax.set_ylim(0, 105)
        uax.set_title(f"{scope}: GPUs held / {cap} GPUs (mean per {width:.3g} {unit})", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel(f"time since first submission ({unit})")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _wait_cdf_figure(results: Sequence[SimResult]) -> Any:
    fig = _matplotlib().figure.Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for r, colour in zip(results, _colours(len(results))):
        w = np.sort([rec.wait_s / 3600.0 for rec in r.records])
        ax.step(
            np.maximum(w, 1e-3),
            np.arange(1, len(w) + 1) / len(w),
            where="post",
            label=r.policy.name,
            color=colour,
            linestyle="--" if r.policy.preempt else "-",
        )
    ax.set_xscale("log")
    ax.set_xlabel("queueing delay (h, log; 0 shown at 0.001)")
    ax.set_ylabel("fraction of jobs (0-1)")
    ax.set_title("Queueing delay CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _ratios_figure(results: Sequence[SimResult]) -> Any:
    """Mean wait and mean job completion time of each policy over the baseline's, on a log axis: 0.5x and 2x
    are as far from 1x."""
    fig = _matplotlib().figure.Figure(figsize=(9, 4.5))
    ax = fig.add_subplot()
    ms = [summarize(r) for r in results]
    base = summarize(baseline(results))
    x = np.arange(len(results))
    wait_colour, jct_colour = _colours(2)
    for offset, label, colour, values, base_value in (
        (-0.2, "mean wait", wait_colour, [m.mean_wait_s for m in ms], base.mean_wait_s),
        (0.2, "mean JCT", jct_colour, [m.mean_jct_s for m in ms], base.mean_jct_s),
    ):
        # A zero (or a zero baseline) has no place on a log axis: it is left out, not drawn as 0.
        ratios = [v / base_value if base_value and v else np.nan for v in values]
        ax.bar(x + offset, ratios, 0.4, label=label, color=colour)
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(x, [r.policy.name for r in results], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(f"ratio to {baseline(results).policy.name} (x, log)")
    ax.legend()
    fig.tight_layout()
    return fig


def _team_share_figure(results: Sequence[SimResult]) -> Any:
    fig = _matplotlib().figure.Figure(figsize=(9, 4.5))
    ax = fig.add_subplot()
    ms = [summarize(r) for r in results]
    teams = sorted({t for m in ms for t in m.share_by_team})
    x = np.arange(len(results))
    bottom = np.zeros(len(results))
    for t, colour in zip(teams, _colours(len(teams))):
        share = np.array([100 * m.share_by_team.get(t, 0.0) for m in ms])
        ax.bar(x, share, 0.6, bottom=bottom, label=t, color=colour)
        bottom += share
    ax.set_xticks(x, [r.policy.name for r in results], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("share of GPU-hours held (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_figures(results: Sequence[SimResult], series: Sequence[Sequence[Interval]] | None = None) -> dict[str, Any]:
    """The simulator's figures by file name (matplotlib Figures): a colour per policy (per team in the team
    share), units on every axis, ratios on a log axis. ``series``: each result's :func:`timeseries`."""
    return {
        "wait_cdf.png": _wait_cdf_figure(results),
        "ratios.png": _ratios_figure(results),
        "team_share.png": _team_share_figure(results),
        "timeseries.png": _timeseries_figure(results, series or [timeseries(r) for r in results]),
    }


def plots(results: Sequence[SimResult], out: Path, series: Sequence[Sequence[Interval]] | None = None) -> list[Path]:
    """Write :func:`plot_figures` under ``out``; ``series``: each result's :func:`timeseries` when already
    computed."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in plot_figures(results, series).items():
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
    return paths


def plot_fill(curves: Sequence[FillCurve], path: Path) -> Path:
    """The fill experiment: unallocated (solid) and fragmented (dashed) share of GPUs against the
    arrived demand, a line per placement policy, a panel per pool."""
    Figure = _matplotlib().figure.Figure

    pools = list(dict.fromkeys(c.pool for c in curves))
    placements = list(dict.fromkeys(c.placement for c in curves))
    colours = dict(zip(placements, _colours(len(placements))))
    fig = Figure(figsize=(5.5 * len(pools), 4.2))
    axes = fig.subplots(1, len(pools), squeeze=False)[0]
    for ax, pool in zip(axes, pools):
        for c in curves:
            if c.pool == pool:
                ax.plot(100 * c.levels, 100 * c.unallocated, "-", color=colours[c.placement], label=f"{c.placement}")
                ax.plot(100 * c.levels, 100 * c.fragmented, "--", color=colours[c.placement])
        ax.plot([0, 100], [100, 0], ":", color="grey", linewidth=0.8, label="every job placed")
        ax.set_xlabel("arrived demand (% of the pool's GPUs)")
        ax.set_ylabel("GPUs unallocated (solid) / fragmented (dashed), %")
        ax.set_title(f"{pool}: fill experiment", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
