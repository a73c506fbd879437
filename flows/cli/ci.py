"""`traingate ci`: what CI calls on merge; its exit code is the verdict (0 passed, 1 a gate or anything
else stopped the ladder, 2 bad input).

- `traingate ci SPEC [--until unit|smoke|canary]`: the ladder's cheap stages of the checked-out code, run
  here against the Prefect server of PREFECT_API_URL, or a temporary one when it is unset.
- `traingate ci --commit SHA`: the `ci-canary` deployment on that commit, on the pool's worker.

Both print how the run ended with the gate's reason (which `prefect deployment run --watch` does not show)
and write a markdown summary to --summary, or to $GITHUB_STEP_SUMMARY when GitHub Actions sets it.
deployments/ci/github-actions.yml calls both.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL

from flows.cli.run import _summary, run_ladder_here
from flows.cli.terminal import follow_run
from flows.cli.validate import _load
from traingate.redact import redact
from traingate.secrets import protect_spec
from traingate.settings import Settings
from traingate.units import usd

CHEAP = ("unit", "smoke", "canary")  # what a merge may spend; full training is the pool's, not CI's


def main(args: argparse.Namespace) -> int:
    if args.spec and args.commit:
        return _refuse("give a spec file (run here) or --commit SHA (run the deployment), not both")
    if args.spec:
        return _local(args)
    if not args.commit:
        return _refuse("give a spec file (traingate ci examples/digits.yaml) or --commit $(git rev-parse HEAD)")
    return _deployment(args)


def _refuse(why: str) -> int:
    print(f"traingate ci: {why}", file=sys.stderr)
    return 2


def _local(args: argparse.Namespace) -> int:
    """The cheap stages of SPEC in this process, as `traingate run --until` does, with a CI verdict."""

    until = args.until or "canary"
    if until not in CHEAP:
        return _refuse(
            f"--until {until!r}: CI runs the cheap stages {', '.join(CHEAP)}; train full on a pool "
            "(traingate run, or the ladder deployment)"
        )
    args.overrides = args.overrides or []
    args.cmd, args.until = "run", until  # _load: validation and preflight of every store, as `run` does
    spec, _ = _load(args)
    spec = protect_spec(spec)
    # A bar in a terminal, a line per stage transition in a CI log.
    state = run_ladder_here(spec, until, Settings.from_env(), follow=follow_run)
    if isinstance(state, int):
        return state
    summary = _summary(state) or {}
    passed = state.is_completed()
    verdict = "PASSED" if passed else "FAILED"
    message = redact(state.message or state.name or "")
    print(f"ci {args.spec} up to {until}: {verdict}: {message}")
    for stage, info in summary.get("stages", {}).items():
        print(
            f"  {stage:<7} {info['status']:<10} gate {'passed' if info['gate'] else 'FAILED':<7} "
            f"{usd(info['cost_usd'])}  restarts {info['restarts']}  mlflow run {info['mlflow_run_id']}"
        )
    if summary:
        print(f"  traingate run: {summary['run_id']}  (traingate show {summary['run_id']})")
    _write_summary(args, f"traingate ci: {args.spec} up to {until}", verdict, message, summary)
    return 0 if passed else 1


def _deployment(args: argparse.Namespace) -> int:
    if not re.fullmatch(r"[0-9a-fA-F]{7,40}", args.commit):
        print(
            f"traingate ci: --commit {args.commit!r} is not a git sha; pass e.g. $(git rev-parse HEAD)", file=sys.stderr
        )
        return 2

    if not PREFECT_API_URL.value():
        print(
            "traingate ci: PREFECT_API_URL is not set: the ci-canary deployment runs on your Prefect server; "
            "set it (e.g. http://prefect:4200/api)",
            file=sys.stderr,
        )
        return 2
    params: dict = {"commit": args.commit}
    if args.spec_path:
        params["spec_path"] = args.spec_path
    if args.overrides is not None:
        params["overrides"] = args.overrides
    if args.until:
        params["until"] = args.until
    try:
        run = run_deployment(args.deployment, parameters=params, timeout=args.timeout, poll_interval=2)
    except ObjectNotFound:
        print(
            f"traingate ci: no deployment {args.deployment!r} on {PREFECT_API_URL.value()}; deploy it with "
            "prefect deploy --prefect-file deployments/prefect.yaml --name ci-canary",
            file=sys.stderr,
        )
        return 2
    assert isinstance(run, FlowRun), "run_deployment called from synchronous code returns the flow run"
    state = run.state
    if state is None or not state.is_final():
        print(
            f"ci {args.commit}: flow run {run.name} ({run.id}) not finished after {args.timeout:.0f} s "
            f"({state.type.value if state else 'no state'})"
        )
        return 1
    verdict = "PASSED" if state.is_completed() else state.type.value
    message = redact(state.message or state.name or "")
    print(f"ci {args.commit}: {verdict}: {message}")
    print(f"  prefect flow run: {run.name} ({run.id})")
    _write_summary(args, f"traingate ci: commit {args.commit} ({args.deployment})", verdict, message, {})
    return 0 if state.is_completed() else 1


def _write_summary(args: argparse.Namespace, title: str, verdict: str, message: str, summary: dict[str, Any]) -> None:
    """Markdown a CI system shows beside the job (GitHub's step summary is appended to, one block per step)."""
    path = args.summary or os.environ.get("GITHUB_STEP_SUMMARY")
    if not path:
        return
    lines = [f"## {title}: {verdict}", "", message.replace("\n", " "), ""]
    if summary.get("stages"):
        lines += ["| stage | status | gate | cost | restarts |", "|---|---|---|---:|---:|"]
        lines += [
            f"| {stage} | {info['status']} | {'passed' if info['gate'] else '**failed**'} | "
            f"{usd(info['cost_usd'])} | {info['restarts']} |"
            for stage, info in summary["stages"].items()
        ]
        lines += ["", f"traingate run `{summary['run_id']}`: `traingate show {summary['run_id']}`", ""]
    with Path(path).open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
