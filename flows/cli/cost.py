"""`traingate cost [--team T] [--experiment E] [--since 7d] [--run RUN_ID]`: spend, idle share, time lost to failures,
cost per successful run and the canary's estimate of full against its actual cost per experiment family,
and scaling advice (1 process vs N), from the runs in the tracking store."""

from __future__ import annotations

import argparse
import re
import sys
import time

from traingate.cost import ledger, scaling
from traingate.cost.source import gather
from traingate.settings import Settings
from traingate.specbase import check_name
from traingate.tracking.runs import client

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``90s``, ``2w`` -> seconds.

    >>> parse_since("7d"), parse_since("90s")
    (604800.0, 90.0)
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--since = {text!r}: give a positive age with a unit s, m, h, d or w, e.g. 7d or 12h")
    return float(m.group(1)) * _UNITS[m.group(2)]


def main(args: argparse.Namespace) -> int:
    try:
        if args.team is not None:
            try:
                check_name(args.team)
            except ValueError as e:
                raise ValueError(f"--team = {args.team!r}: {e}") from None
        if args.run is not None and (args.team or args.experiment or args.since):
            raise ValueError(f"--run = {args.run!r} names one run: leave --team, --experiment and --since out")
        since_ms = int((time.time() - parse_since(args.since)) * 1000) if args.since else None
        settings = Settings.from_env()
        got = gather(
            client(settings.tracking_uri),
            experiment=args.experiment,
            team=args.team,
            since_ms=since_ms,
            run_id=args.run,
        )
    except ValueError as e:
        print(f"traingate cost: {e}", file=sys.stderr)
        return 2
    scope = (
        ", ".join(
            x
            for x in (
                f"team {args.team}" if args.team else "",
                f"experiment {args.experiment}" if args.experiment else "",
                f"since {args.since} ago" if args.since else "",
                f"run {args.run}" if args.run else "",
            )
            if x
        )
        or "all runs"
    )
    text = ledger.render(ledger.report(got.runs), title=f"cost: {scope} ({len(got.runs)} runs)")
    advice = scaling.by_family(got.runs)
    if advice:
        text += "\n## scaling (smoke at 1 process vs canary, the newest run that measured both)\n\n" + "".join(
            f"- {exp} (run {rid}): {a.sentence}\n" for exp, (rid, a) in advice.items()
        )
    if got.skipped:
        text += "\nnot charged (no record of their attempts):\n" + "".join(f"- {s}\n" for s in got.skipped)
    print(text, end="" if text.endswith("\n") else "\n")
    return 0
