"""`traingate watch RUN_ID [--interval S] [--once]`: a live view of a run in the terminal.

Stage, progress with ETA, loss and throughput sparklines, per-rank step times, GPU utilisation,
alerts, restarts and dollars, redrawn every ``--interval`` seconds from the run's files
(:mod:`traingate.monitor.dashboard`). It ends by itself when the run has ended, and on Ctrl-C,
each time with a one-line summary and exit 0. Works over SSH: 80 columns, no mouse, no screen switch.
"""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.live import Live

from flows.cli.console import terminal_of
from traingate.monitor import dashboard
from traingate.settings import Settings

EXIT_USAGE = 2


def main(args: argparse.Namespace) -> int:
    runs = Settings.from_env().state_dir / "runs"
    run_dir = runs / args.run_id
    if not args.run_id or "/" in args.run_id or not (run_dir / "spec.yaml").is_file():
        print(
            f"traingate watch: no run {args.run_id!r} under {runs}; list runs with `traingate runs` "
            "(and use the same TRAINGATE_STATE_DIR)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not args.interval > 0:
        print(f"traingate watch: --interval = {args.interval:g}: needs seconds > 0, e.g. --interval 2", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _watch(run_dir, args.interval, args.once)
    except KeyboardInterrupt:  # Ctrl-C is how a watcher leaves: not an error, and no traceback
        print(f"traingate watch: stopped watching; {dashboard.summary_line(dashboard.read_snapshot(run_dir))}")
        return 0


def _watch(run_dir, interval: float, once: bool) -> int:
    console = Console(file=terminal_of(sys.stdout))  # rich writes the screen: a library, on traingate's behalf
    reader = dashboard.RunReader(run_dir)
    if once:
        console.print(dashboard.render(reader.snapshot(), min(console.width, 100)))
        return 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while True:
            over = dashboard.run_over(run_dir)  # before the snapshot: the last screen shows the end
            snap = reader.snapshot()
            live.update(dashboard.render(snap, min(console.width, 100)), refresh=True)
            if over is not None:
                break
            time.sleep(interval)
    if not console.is_terminal:  # piped, Live leaves its last screen without a line end
        console.line()
    print(f"traingate watch: run over ({over}); {dashboard.summary_line(snap)}")
    return 0
