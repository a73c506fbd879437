"""`traingate simulate TRACE.csv --pools CONFIG`: replay a job trace through the scheduling policies
(traingate/capacity: no Prefect, no processes) and compare them; writes a table, plots and schedules."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from traingate.capacity.figures import figures, timeseries
from traingate.capacity.fill import fill, fill_table, parse_placements, write_fill
from traingate.capacity.load import LOAD_RANGE, at_load, offered_load
from traingate.capacity.policy import Policy
from traingate.capacity.pools import CapacityConfig, CapacityError, Placement, load_config
from traingate.capacity.report import (
    COMPARED,
    plot_fill,
    plots,
    report,
    write_figures,
    write_schedule,
    write_timeseries,
)
from traingate.capacity.simulate import TraceJob, simulate
from traingate.capacity.trace import TraceParams, generate, read_trace, write_trace
from traingate.settings import Settings


def main(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except CapacityError as e:
        print(f"traingate simulate: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    config = load_config(args.pools)
    default = Policy.default(config.scheduling)
    policies = [Policy.parse(p) for p in (args.policies or ",".join(COMPARED)).split(",") if p.strip()]
    if args.policies is None and default not in policies:
        policies.append(default)  # the comparison shows what the pools run
    if not policies:
        raise CapacityError("--policies is empty; name at least one, e.g. --policies fifo,fairshare+backfill")
    if args.half_life_h is not None and not args.half_life_h > 0:
        raise CapacityError(f"--half-life-h = {args.half_life_h}: must be > 0 (hours)")
    trace_path = Path(args.trace)
    if args.generate is not None:
        _generate(args, config, trace_path)
    if args.fill:
        return _fill(args, config, trace_path)
    if args.placements is not None:
        raise CapacityError(
            "--placements compares placements in the fill experiment (--fill); the replay takes one: --placement NAME"
        )
    trace = read_trace(trace_path, config, args.pool)
    config = _with_placement(config, args.placement, trace)
    shared = any(tj.job.milli for tj in trace)
    if shared and args.policies is None:
        policies = [p for p in policies if not p.preempt]  # a preemption frees whole GPUs: none on shared GPUs
    recorded = offered_load(trace, config) if len({tj.job.submit_s for tj in trace}) > 1 else None
    if args.load is not None and args.generate is None:
        trace = at_load(trace, config, args.load)
    out = Path(args.out) if args.out else Settings.from_env().state_dir / "simulate" / trace_path.stem
    out.mkdir(parents=True, exist_ok=True)
    results = [simulate(trace, config, p, args.half_life_h) for p in policies]
    pools = sorted({p for tj in trace for p in tj.accepts})
    figs = [figures(r) for r in results]
    series = [timeseries(r) for r in results]
    text = report(
        results,
        f"{len(trace)} jobs from {trace_path.name} on "
        + ", ".join(f"{p} ({config.pools[p].capacity} GPUs)" for p in pools)
        + _load_note(recorded, args.load if args.generate is None else None)
        + (f"; shared GPUs placed {config.simulator.placement}, no +preempt" if shared else ""),
        default,
        figs,
    )
    (out / "table.md").write_text(text)
    for r, s in zip(results, series):
        write_schedule(r, out / f"schedule-{r.policy.name}.csv")
        write_timeseries(s, out / f"timeseries-{r.policy.name}.csv")
    written = write_figures(results, figs, out) + plots(results, out, series)
    print(text)
    print(
        f"written: {out / 'table.md'}, {', '.join(p.name for p in written)}, schedule-<policy>.csv, "
        f"timeseries-<policy>.csv in {out}"
    )
    return 0


def _fill(args: argparse.Namespace, config: CapacityConfig, trace_path: Path) -> int:
    """The fill experiment on every pool the trace's jobs accept, per placement policy."""
    for flag, value in (("--policies", args.policies), ("--half-life-h", args.half_life_h)):
        if value is not None:
            raise CapacityError(f"{flag} does nothing with --fill (it compares placements, not policies); drop it")
    if args.load is not None and args.generate is None:
        raise CapacityError("--load does nothing with --fill (jobs arrive until the pool is full); drop it")
    if args.placement is not None:
        raise CapacityError("--placement places the replay's jobs; --fill compares placements: --placements A,B")
    placements = parse_placements(args.placements or ",".join(Placement))
    if args.fill_runs < 1:
        raise CapacityError(f"--fill-runs = {args.fill_runs}: must be at least 1")
    trace = read_trace(trace_path, config, args.pool)
    out = Path(args.out) if args.out else Settings.from_env().state_dir / "simulate" / trace_path.stem
    out.mkdir(parents=True, exist_ok=True)
    curves = []
    for name in sorted({p for tj in trace for p in tj.accepts}):
        pool = config.pools[name]
        asks = [tj.job.slots if tj.gpus is None else tj.gpus for tj in trace if name in tj.accepts]
        curves += [fill(name, pool.nodes, pool.gpus_per_node, asks, p, args.fill_runs, args.seed) for p in placements]
    text = (
        f"Fill experiment: jobs sampled from {trace_path.name} ({len(trace)} jobs) arrive and stay until their "
        f"demand reaches each pool's capacity; {args.fill_runs} runs per placement, seeds {args.seed}.. "
        f"Shares of the pool's GPUs at each arrived demand (a share of its capacity):\n\n" + fill_table(curves)
    )
    (out / "fill.md").write_text(text)
    write_fill(curves, out / "fill.csv")
    plot_fill(curves, out / "fill.png")
    print(text)
    print(f"written: {out / 'fill.md'}, fill.csv, fill.png in {out}")
    return 0


def _with_placement(config: CapacityConfig, name: str | None, trace: list[TraceJob]) -> CapacityConfig:
    """``config`` with ``--placement`` as its ``simulator.placement``; a warning when no job asks a
    fraction of a GPU (whole GPUs are placed best fit on a pool without shared GPUs)."""
    if name is None:
        return config
    if name not in {p.value for p in Placement}:
        raise CapacityError(f"--placement {name!r} is not a placement policy; use one of {', '.join(Placement)}")
    if not any(tj.job.milli for tj in trace):
        print(
            f"traingate simulate: warning: --placement {name} does nothing here: no job asks a fraction of a GPU, "
            f"and whole GPUs on pools without shared GPUs are placed best fit",
            file=sys.stderr,
        )
    sim = config.simulator.model_copy(update={"placement": Placement(name)})
    return config.model_copy(update={"simulator": sim})


def _generate(args: argparse.Namespace, config: CapacityConfig, trace_path: Path) -> None:
    if args.generate < 1:
        raise CapacityError(f"--generate = {args.generate}: must be at least 1 job")
    if args.load is None:
        args.load = 0.8
    lo, hi = LOAD_RANGE
    if not lo <= args.load <= hi:
        raise CapacityError(
            f"--load = {args.load:g}: must be between {lo:g} and {hi:g} (offered GPU time / the pool's)"
        )
    if trace_path.exists():
        raise CapacityError(f"--generate would overwrite {str(trace_path)!r}; remove it or name a new file")
    pool_name = args.pool or (next(iter(config.pools)) if len(config.pools) == 1 else None)
    if pool_name is None:
        raise CapacityError(f"--generate sizes the trace for one pool; pass --pool with one of {sorted(config.pools)}")
    if pool_name not in config.pools:
        raise CapacityError(f"--pool {pool_name!r} is not in the pools config; use one of {sorted(config.pools)}")
    pool = config.pools[pool_name]
    write_trace(
        trace_path,
        generate(
            TraceParams(
                n_jobs=args.generate,
                capacity=pool.capacity,
                gpus_per_node=pool.gpus_per_node,
                load=args.load,
                seed=args.seed,
            )
        ),
    )
    print(f"generated {args.generate} jobs into {trace_path} (pool {pool_name}, load {args.load}, seed {args.seed})")


def _load_note(recorded: float | None, target: float | None) -> str:
    """What load the replayed trace offers: as recorded, or scaled to ``--load``."""
    if recorded is None:
        return ""
    if target is None:
        return f", offered load {recorded:.2f}"
    return f", arrivals scaled from offered load {recorded:.2f} to {target:g}"
