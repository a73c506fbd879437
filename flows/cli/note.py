"""`traingate note RUN_ID "text"`: add a timestamped note to a run's logbook."""

from __future__ import annotations

import argparse
import getpass

from mlflow.exceptions import MlflowException

from traingate.settings import Settings
from traingate.tracking.runs import add_note, client


def main(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    try:
        note = add_note(client(settings.tracking_uri), args.run_id, args.text, args.author or getpass.getuser())
    except ValueError as e:
        print(f"traingate note: {e}")
        return 2
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        print(f"traingate note: no run {args.run_id!r} in {settings.tracking_uri}; list runs with `traingate runs`")
        return 2
    print(f"noted on {args.run_id} at {note['time']}")
    return 0
