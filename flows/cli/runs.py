"""`traingate runs [--experiment E] [--team T] [--sort METRIC]`: list and compare pipeline runs."""

from __future__ import annotations

import argparse
import sys

from traingate.settings import LocationError, store_to_read
from traingate.tracking import browse
from traingate.tracking.runs import client


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
