"""`traingate runs [--experiment E] [--team T] [--sort METRIC]`: list and compare pipeline runs."""

from __future__ import annotations

import argparse
import sys

from traingate.settings import LocationError, store_to_read
from traingate.tracking import browse
from traingate.tracking.runs import client


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", help="only this MLflow experiment")
    p.add_argument("--team", help="only runs of this team")
    p.add_argument(
        "--sort",
        metavar="METRIC",
        help="order by a metric of each run's deepest stage, e.g. val_accuracy (highest first)",
    )
    p.add_argument("--asc", action="store_true", help="with --sort: lowest first")
    p.add_argument("--limit", type=int, default=50, help="at most this many rows (default 50)")


def main(args: argparse.Namespace) -> int:
    try:
        c = client(store_to_read("runs").tracking_uri)
    except LocationError as e:
        print(f"traingate runs: {e}", file=sys.stderr)
        return 2
    try:
        rows = browse.list_runs(c, args.experiment, args.team, args.sort, args.asc, args.limit)
    except ValueError as e:
        print(f"traingate runs: {e}")
        return 2
    print(browse.render_runs(rows, args.sort), end="")
    return 0
