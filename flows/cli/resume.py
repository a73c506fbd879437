"""`traingate resume RUN_ID [--until STAGE] [--stage STAGE]`: continue an interrupted run.

Finds the run's first unfinished stage under the state dir and runs the ladder flow from
there (same run id, same MLflow runs, latest valid checkpoint) up to ``--until`` (default
full): the parent run is closed and a passing full stage is promoted, as if never interrupted.
"""

from __future__ import annotations

import argparse

from flows import local_server
from flows.cli import console
from flows.cli.run import guard_this_process, interrupted
from flows.cli.terminal import follow_run
from flows.pipeline import ResumeFrom, ladder, no_flow_heartbeats, summary_of
from traingate.ladder.plan import resume_point
from traingate.secrets import check_refs
from traingate.settings import Settings
from traingate.spec import STAGES


def main(args: argparse.Namespace) -> int:
    point = resume_point(Settings.from_env(), args.run_id, args.stage)  # a bad run id: one line, exit 2
    check_refs(point.spec.to_dict())  # its ${env:} secrets must be exported again here: one line if not
    if args.overrides:  # a bad --set: one line, exit 2, before anything starts
        point.spec.with_overrides(args.overrides)
    if STAGES.index(args.until) < STAGES.index(point.stage):
        print(f"traingate resume: --until {args.until} is before the stage to resume, {point.stage}")
        return 2

    guard_this_process(point.spec.supervision.preempt_grace_s)
    console.attach(Settings.from_env().state_dir / "runs" / args.run_id)  # the run's log: appended to
    try:
        # a progress bar in a terminal, a line per stage transition elsewhere
        with follow_run(Settings.from_env()), no_flow_heartbeats():
            state = ladder(
                None,
                args.until,
                ResumeFrom.model_validate({"run_id": args.run_id, "stage": point.stage, "overrides": args.overrides}),
                return_state=True,
            )
    except KeyboardInterrupt:  # the second Ctrl-C: no waiting for the checkpoint
        return interrupted(args.run_id)
    data = summary_of(state)
    print(f"resume {'PASSED' if state.is_completed() else 'STOPPED'}: {state.message}")
    if data is not None:
        for name, info in data["stages"].items():
            print(
                f"  {name:<7} {info['status']:<10} gate {'passed' if info['gate'] else 'FAILED':<7} "
                f"restarts {info['restarts']}  resumed from step {info['resumed_from_step']}"
            )
        model = data.get("model") or {}
        if model.get("registered"):
            print(f"  model:           models:/{model['name']}@{model['alias']} (version {model['version']})")
    print(f"  Prefect UI: {local_server.ui_hint(Settings.from_env().state_dir)}")
    return 0 if state.is_completed() else 1
