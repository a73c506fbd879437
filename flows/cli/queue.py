"""`traingate queue [--pool P]`: running and waiting training jobs per pool, as the scheduler sees them.

Running jobs show when they started (UTC) and for how long they have run; waiting jobs are listed in
the order the pool's policy serves them, each with its position, class, team, slots, the time it joined
the queue (UTC), time waited so far and an estimated start (the earliest time it fits if the
running jobs end as predicted; "unknown" without predictions). A local pool's jobs are read from its
authority's signed records; a record the authority did not sign is left out and reported on an
``ignored:`` line. A Slurm pool shows Slurm's queue of
its partition: each job's QOS, account, pending reason (Priority, Resources, AssocGrpGRES, QOS...)
and Slurm's own start estimate.
"""

from __future__ import annotations

import argparse
import sys
import time

from prefect import get_client

from flows.cli.pools import _require_server
from tasks import slots
from traingate.capacity import records, slurm, slurm_cli
from traingate.capacity.gang import footprint
from traingate.capacity.policy import queue_order
from traingate.capacity.pools import CapacityError, Engine
from traingate.capacity.queue import RUNNING, WAITING, Entry, _predict, decide, rules_for, usage_now
from traingate.settings import Settings
from traingate.units import UTC_LABEL, duration, utc


def main(args: argparse.Namespace) -> int:
    try:
        _require_server("the queue lives")
        with get_client(sync_client=True) as c:
            cfg = slots.read_config(c)
            if cfg is None:
                raise CapacityError(
                    "this Prefect server has no capacity config; run `traingate pools bootstrap POOLS.yaml`"
                )
            if args.pool and args.pool not in cfg.pools:
                raise CapacityError(f"--pool {args.pool!r}: not a pool; use one of {sorted(cfg.pools)}")
        now = time.time()
        live, history, ignored = local_queue(cfg, Settings.from_env().state_dir, args.pool)
        shown = [p for name, p in cfg.pools.items() if not args.pool or name == args.pool]
        # Slurm pools: the queue is Slurm's (one squeue for all of them; it ignores filters in JSON mode).
        jobs = slurm.queued_jobs(slurm_cli.squeue()) if any(p.engine == Engine.SLURM for p in shown) else []
        print(render(cfg, live, history, now, args.pool, jobs))
        for line in ignored:
            print(f"ignored: {line}")
    except (CapacityError, slurm.SlurmError) as e:
        print(f"traingate queue: {e}", file=sys.stderr)
        return 2
    return 0


def local_queue(cfg, state_dir, only: str | None = None) -> tuple[list[Entry], dict, list[str]]:
    """The local pools' entries and usage as their authorities signed them, and one line per record that
    was not signed by the authority (ignored, as the authority ignores it)."""
    live: list[Entry] = []
    history: dict[str, dict[str, tuple[float, float]]] = {}
    ignored: list[str] = []
    for name, pool in cfg.pools.items():
        if pool.engine != Engine.LOCAL or (only and name != only):
            continue
        got = records.read_pool(state_dir, name)
        live += [Entry.from_json(v["entry"]) for v in got.of(records.ENTRY).values()]
        history[name] = {t: (float(u), float(a)) for t, (u, a) in got.of(records.USAGE).items()}
        ignored += [f"pool {name}: {line}" for line in got.ignored]
    return live, history, ignored


def render(cfg, live, history, now: float, only: str | None = None, slurm_jobs=()) -> str:
    """The queue view as text (pure: config, fresh entries, usage history, now; a Slurm pool's from ``slurm_jobs``,
    what squeue printed)."""

    out: list[str] = []
    for name, pool in cfg.pools.items():
        if only and name != only:
            continue
        if pool.engine == Engine.SLURM:
            out += slurm.queue_lines(name, pool.slurm, list(slurm_jobs), now)
            continue
        mine = [e for e in live if e.pool == name]
        running = [e for e in mine if e.state == RUNNING]
        waiting = [e for e in mine if e.state == WAITING]
        used = sum(footprint(e.slots, pool.gpus_per_node) for e in running)
        out.append(f"pool {name}: {used}/{pool.capacity} slots in use, {len(running)} running, {len(waiting)} waiting")
        for e in sorted(running, key=lambda e: e.started_s or 0.0):
            started = e.started_s or now
            out.append(
                f"  running  {e.job_id:<28} {e.priority:<11} {e.team:<10} {e.slots:>3} slots  "
                f"started {utc(started)} {UTC_LABEL}  for {duration(now - started):>8}  {e.progress}".rstrip()
            )
        usage = usage_now(history.get(name, {}), running, now, cfg.scheduling.half_life_h * 3600.0)
        rules = rules_for(cfg, name, [e.team for e in mine])
        for e in [
            next(w for w in waiting if w.job_id == j.job_id)
            for j in queue_order(
                [w.job() for w in waiting],
                rules.policy,
                rules.classes,
                usage,
                _predict,
                now,
                starvation_bound_s=rules.starvation_bound_s,
            )
        ]:
            d = decide(e.job_id, mine, cfg, now, usage)
            est = (
                "now"
                if d.start
                else ("unknown" if d.est_start_s is None else f"in {duration(max(0.0, d.est_start_s - now))}")
            )
            out.append(
                f"  #{d.position:<3}     {e.job_id:<28} {e.priority:<11} {e.team:<10} {e.slots:>3} slots  "
                f"queued  {utc(e.submit_s)} {UTC_LABEL}  waited {duration(now - e.submit_s):>5}  start {est} ({d.why})"
            )
    return "\n".join(out)
