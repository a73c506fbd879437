"""`traingate ci --commit SHA`: what CI calls on merge. Runs the `ci-canary` deployment on that commit.

Triggers the deployment through the Prefect API (PREFECT_API_URL), waits for the flow run and
prints how it ended with the gate's reason, which `prefect deployment run --watch` does not show.
Exit 0 when the ladder passed, 1 when a gate (or anything else) stopped it, 2 on bad input.
"""
from __future__ import annotations

import argparse
import re
import sys

from traingate.spec import STAGES

DEPLOYMENT = "pipeline/ci-canary"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--commit", required=True, help="the commit to test (a sha of the repository the pool's "
                   "worker clones: TRAINGATE_CI_REPOSITORY)")
    p.add_argument("--deployment", default=DEPLOYMENT, help=f"default {DEPLOYMENT}")
    p.add_argument("--spec", help="spec file inside the commit (default: the deployment's)")
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                   help="override a spec field (repeatable)")
    p.add_argument("--until", choices=STAGES, help="last stage (default: the deployment's)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run (default 3600)")


def main(args: argparse.Namespace) -> int:
    if not re.fullmatch(r"[0-9a-fA-F]{7,40}", args.commit):
        print(f"traingate ci: --commit {args.commit!r} is not a git sha; pass e.g. $(git rev-parse HEAD)",
              file=sys.stderr)
        return 2
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        print("traingate ci: PREFECT_API_URL is not set: the ci-canary deployment runs on your Prefect server; "
              "set it (e.g. http://prefect:4200/api)", file=sys.stderr)
        return 2
    params: dict = {"commit": args.commit}
    if args.spec:
        params["spec_path"] = args.spec
    if args.overrides is not None:
        params["overrides"] = args.overrides
    if args.until:
        params["until"] = args.until
    try:
        run = run_deployment(args.deployment, parameters=params, timeout=args.timeout, poll_interval=2)
    except ObjectNotFound:
        print(f"traingate ci: no deployment {args.deployment!r} on {PREFECT_API_URL.value()}; deploy it with "
              "prefect deploy --prefect-file deployments/prefect.yaml --name ci-canary", file=sys.stderr)
        return 2
    state = run.state
    if state is None or not state.is_final():
        print(f"ci {args.commit}: flow run {run.name} ({run.id}) not finished after {args.timeout:.0f} s "
              f"({state.type.value if state else 'no state'})")
        return 1
    verdict = "PASSED" if state.is_completed() else state.type.value
    print(f"ci {args.commit}: {verdict}: {state.message or state.name}")
    print(f"  prefect flow run: {run.name} ({run.id})")
    return 0 if state.is_completed() else 1
