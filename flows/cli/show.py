"""`traingate show RUN_ID`: identity, stages, gates, restarts, notes and cost of a run."""

from __future__ import annotations

import argparse
import sys

from mlflow.exceptions import MlflowException

from traingate.settings import LocationError, store_to_read
from traingate.tracking import browse
from traingate.tracking.runs import client


def main(args: argparse.Namespace) -> int:
    try:
        settings = store_to_read("show")
    except LocationError as e:
        print(f"traingate show: {e}", file=sys.stderr)
        return 2
    try:
        print(browse.show_run(client(settings.tracking_uri), args.run_id), end="")
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        print(f"traingate show: no run {args.run_id!r} in {settings.tracking_uri}; list runs with `traingate runs`")
        return 2
    return 0
