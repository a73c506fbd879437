"""The `traingate` command.

    traingate validate SPEC [--set k=v ...]            print the resolved spec
    traingate run SPEC [--set k=v ...] [--until STAGE] [--dry-run]

A spec error prints one line naming the field, the value and the fix, exits 2,
and starts nothing: validation runs before Prefect or MLflow is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Callable, ContextManager

import yaml

from flows import logsafety
from traingate.redact import redact
from traingate.secrets import extract, move_tracking_credentials, protect_spec
from traingate.settings import Settings
from traingate.spec import STAGES, SpecError, load_spec, parse_spec

EXIT_SPEC = 2

# Further subcommands, each a module with add_arguments(parser) and main(args) -> int.
# Modules are imported only when their command runs (and to build --help).
EXTRA_COMMANDS: dict[str, tuple[str, str]] = {
    "resume": ("flows.commands.resume", "continue a preempted or failed run from its latest checkpoint"),
    "drill": ("flows.commands.drill", "fault-injection drill: break a run on purpose, check it ends bitwise equal"),
    "sweep": ("flows.commands.sweep", "run or resume the spec's hyperparameter sweep (Optuna; --promote the best)"),
    "runs": ("flows.commands.runs", "list and compare runs (by experiment, team, metric)"),
    "show": ("flows.commands.show", "identity, stages, gates, restarts, notes and cost of a run"),
    "watch": ("flows.commands.watch", "live view of a run: progress, ETA, loss, ranks, alerts, restarts, dollars"),
    "note": ("flows.commands.note", "add a timestamped note to a run's logbook"),
    "replay": ("flows.commands.replay", "deliver a run's journals to the tracking store after it was lost"),
    "pools": (
        "flows.commands.pools",
        "create the work pools, queues, slot and quota limits of a pools config on the server",
    ),
    "queue": ("flows.commands.queue", "running and waiting training jobs per pool: position, class, team, slots, wait"),
    "simulate": ("flows.commands.simulate", "replay a job trace through the scheduling policies and compare them"),
    "ci": (
        "flows.commands.ci",
        "CI verdict as exit code: a spec's cheap stages here, or the ci-canary deployment on --commit",
    ),
    "cost": ("flows.commands.cost", "spend, idle share, time lost to failures, cost per successful run per experiment"),
    "retrain": (
        "flows.commands.retrain",
        "retrain on the newest data snapshot; the new model takes @champion only if better",
    ),
}


def _embedded_defaults(settings: Settings) -> None:
    """Keep Prefect's home inside the state dir and its telemetry off (set before importing prefect)."""
    os.environ.setdefault("PREFECT_HOME", str(settings.state_dir / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    # The temporary server's 20 s default is too tight on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser. Only ``command``'s module is imported to add its arguments (several
    import Prefect or MLflow: seconds a `traingate simulate` or a refused spec should not pay)."""
    p = argparse.ArgumentParser(prog="traingate", description="staged model training on Prefect")
    p.add_argument("--version", action="version", version=f"traingate {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def spec_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("spec", help="RunSpec YAML file")
        sp.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a spec field, e.g. --set optim.lr=0.001 (repeatable)",
        )

    v = sub.add_parser("validate", help="validate a spec and print it fully resolved")
    spec_args(v)
    r = sub.add_parser("run", help="run the ladder (Prefect flow `ladder`)")
    spec_args(r)
    r.add_argument("--until", choices=STAGES, default="full", help="last stage to run")
    r.add_argument("--dry-run", action="store_true", help="print the plan and estimated cost; run nothing")
    for name, (module, help_text) in EXTRA_COMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if command in (name, None):
            __import__(module, fromlist=["add_arguments"]).add_arguments(sp)
    return p


def _version() -> str:
    """The installed distribution's version: the one pip, the image and `traingate --version` agree on."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("traingate")
    except PackageNotFoundError:  # a source checkout that was never installed (pip install -e .)
        return "unknown (not installed: pip install -e .)"


def _load(args: argparse.Namespace) -> tuple[Any, dict[str, int]]:
    from traingate.ladder.preflight import check_spec, preflight
    from traingate.snapshots import resolve_spec

    # data.uri's {latest} is resolved once, here: the ladder and every stage read that same version.
    spec = resolve_spec(load_spec(args.spec, args.overrides))
    samples = check_spec(spec)
    if args.cmd == "run":
        # Every store the run will use answers before anything is created (`validate` stays offline).
        preflight(spec, Settings.from_env())
    return spec, samples


def cmd_validate(args: argparse.Namespace) -> int:
    spec, _ = _load(args)
    # Printed as `run` records it: each literal secret a ${env:TRAINGATE_SECRET_<n>} reference.
    tree, _, _ = extract(spec.to_dict())
    print(yaml.safe_dump(tree, sort_keys=False), end="")
    print(f"# spec ok: hash {parse_spec(tree).spec_hash()}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from traingate.ladder.plan import plan, render
    from traingate.tracking.prior import latest_canary_profile

    spec, samples = _load(args)
    spec = protect_spec(spec)  # the flow-run parameters, spec file and job files hold references, not secrets
    settings = Settings.from_env()
    prior = latest_canary_profile(settings, spec.identity.experiment, spec.recipe.name)
    print(render(plan(spec, samples, args.until, profile=prior), spec))
    if prior:
        print(
            f"(estimates from the latest canary of {spec.identity.experiment!r}: "
            f"{prior['step_time_mean_s'] * 1000:.1f} ms/step)"
        )
    if args.dry_run:
        return 0
    from flows.terminal import follow_run

    # A progress bar in a terminal, one line per stage transition elsewhere.
    state = run_ladder_here(spec, args.until, settings, follow=follow_run)
    if isinstance(state, int):
        return state
    summary = _summary(state)
    print()
    print(f"pipeline {'PASSED' if state.is_completed() else 'STOPPED'}: {state.message}")
    if summary:
        print(f"  traingate run / MLflow parent run: {summary['run_id']}")
        for stage, info in summary["stages"].items():
            print(
                f"  {stage:<7} {info['status']:<10} gate {'passed' if info['gate'] else 'FAILED':<7} "
                f"mlflow run {info['mlflow_run_id']}  ${info['cost_usd']:.4f}"
            )
        if summary.get("checkpoint_uri"):
            print(f"  checkpoint:      {redact(summary['checkpoint_uri'])}")
        model = summary.get("model") or {}
        if model.get("registered"):
            print(f"  model:           models:/{model['name']}@{model['alias']} (version {model['version']})")
        elif model:
            print(f"  model not registered: {redact('; '.join(model.get('reasons', [])))}")
        print(f"  prefect flow run: {summary['flow_run_id']}")
        print(f"  stage outputs:   {summary['run_dir']}")
    print(f"  MLflow UI:  mlflow ui --backend-store-uri {redact(settings.tracking_uri)}")
    print(f"  Prefect UI: PREFECT_HOME={os.environ['PREFECT_HOME']} prefect server start")
    return 0 if state.is_completed() else 1


def run_ladder_here(
    spec: Any, until: str, settings: Settings, follow: Callable[[Settings], ContextManager[Any]] | None = None
) -> Any:
    """The ladder flow in this process, as `run` and `ci` start it: the state dir made, the process
    guarded (Ctrl-C preempts at a checkpoint), ``follow(settings)`` around the flow when given.

    Returns the flow's final state, or the exit code of a second Ctrl-C (no waiting for the checkpoint).
    """
    from flows.pipeline import ladder

    settings.ensure()
    guard_this_process(spec.supervision.preempt_grace_s)
    try:
        with follow(settings) if follow is not None else contextlib.nullcontext():
            return ladder(spec, until, return_state=True)
    except KeyboardInterrupt:
        return interrupted(_claimed_run(settings))


def guard_this_process(grace_s: float) -> None:
    """Nothing this process starts outlives it, and Ctrl-C preempts the running stage at a checkpoint.

    A guardian process stops the temporary Prefect server and any process tree if this process is
    killed (traingate.supervision.guardian). The first Ctrl-C asks every supervised tree to write its
    emergency checkpoint and stop, so the flow ends Cancelled with the resume command; a second one aborts.
    """
    import signal

    from traingate.supervision import guardian, supervisor

    guardian.ensure(grace_s + 10.0)
    _start_prefect_server_shielded()

    def on_sigint(signum: int, frame: Any) -> None:
        if supervisor.stop_request():
            raise KeyboardInterrupt
        supervisor.request_stop("interrupted (Ctrl-C)")
        print(
            "traingate: Ctrl-C: preempting the running stage at a checkpoint (Ctrl-C again to abort now)",
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGINT, on_sigint)


EXIT_INTERRUPTED = 130  # as a shell reports a command that SIGINT ended


def interrupted(run_id: str | None) -> int:
    """What an aborted `run` or `resume` prints: one line with the resume command, no traceback."""
    if run_id is None:
        print("traingate: aborted (Ctrl-C) before a run was created; nothing to resume", file=sys.stderr)
    else:
        print(
            f"traingate: aborted (Ctrl-C) without waiting for a checkpoint: run {run_id}; continue with: "
            f"traingate resume {run_id}",
            file=sys.stderr,
        )
    return EXIT_INTERRUPTED


def _claimed_run(settings: Settings) -> str | None:
    """The run this process was orchestrating: the newest run directory that names this process as its
    orchestrator (the ladder records it as it starts, traingate.tracking.stale.claim)."""
    from traingate.tracking import stale

    mine = [
        d
        for d in (settings.state_dir / "runs").glob("*")
        if (o := stale.read_orchestrator(d)) is not None and o.pid == os.getpid()
    ]
    return max(mine, key=lambda d: (d / stale.ORCHESTRATOR).stat().st_mtime).name if mine else None


def _start_prefect_server_shielded() -> None:
    """Start Prefect's temporary server now (when no PREFECT_API_URL names one) with SIGINT blocked.

    A terminal's Ctrl-C goes to the whole foreground process group, and Prefect starts its temporary
    server in ours: it died of the first Ctrl-C, and the run it was recording ended in connection
    errors and a traceback instead of a Cancelled state with the resume command. A blocked signal
    stays blocked across fork and exec, so the server never sees it; it still stops with this process
    (SIGTERM at exit, the guardian if this process is killed).
    """
    import signal

    from prefect import get_client

    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with get_client(sync_client=True):  # starts the temporary server here, in this thread, if one is used
            pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _summary(state: Any) -> dict[str, Any] | None:
    from flows.pipeline import summary_of

    return summary_of(state)


def main(argv: list[str] | None = None) -> int:
    _embedded_defaults(Settings.from_env())  # before anything imports prefect
    logsafety.install()  # before anything logs: Prefect's API log handler stores what it is given
    given = sys.argv[1:] if argv is None else argv
    command = next((a for a in given if not a.startswith("-")), None)
    args = _parser(command if command in EXTRA_COMMANDS else "").parse_args(argv)
    try:
        move_tracking_credentials()  # the tracking URI is written everywhere; MLflow's credential variables are not
        if args.cmd in EXTRA_COMMANDS:
            return __import__(EXTRA_COMMANDS[args.cmd][0], fromlist=["main"]).main(args)
        return {"validate": cmd_validate, "run": cmd_run}[args.cmd](args)
    except SpecError as e:
        # One line, whatever a message quoted: the promise is a line a script can grep.
        print(f"traingate: invalid spec: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return EXIT_SPEC


if __name__ == "__main__":
    sys.exit(main())
