"""The `traingate` command as it runs in a process: the command table, every command's arguments, and the
command run (:func:`run`). ``flows.cli.main`` hands run/resume/sweep to the kept server's engine first and
imports this module only when the command runs here: its imports (the spec's models, the arguments) are what a
forwarded command does not pay for."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from flows import cli_engine, cli_forward, local_server, logsafety
from flows.cli import arguments, console
from traingate.secrets import move_tracking_credentials
from traingate.settings import Settings
from traingate.spec import SpecError

EXIT_SPEC = 2

# Every command: its one-line help. Its arguments: the function of that name in flows.cli.arguments;
# what it does: main(args) -> int of the module of that name in this package, imported only when it runs.
COMMANDS: dict[str, str] = {
    "validate": "validate a spec and print it fully resolved",
    "run": "run the ladder (Prefect flow `ladder`)",
    "resume": "continue a preempted or failed run from its latest checkpoint",
    "drill": "fault-injection drill: break a run on purpose, check it ends bitwise equal",
    "sweep": "run or resume the spec's hyperparameter sweep (Optuna; --promote the best)",
    "runs": "list and compare runs (by experiment, team, metric)",
    "show": "identity, stages, gates, restarts, notes and cost of a run",
    "watch": "live view of a run: progress, ETA, loss, ranks, alerts, restarts, dollars",
    "note": "add a timestamped note to a run's logbook",
    "replay": "deliver a run's journals to the tracking store after it was lost",
    "pools": "create the work pools, queues, slot and quota limits of a pools config on the server",
    "queue": "running and waiting training jobs per pool: position, class, team, slots, wait",
    "simulate": "replay a job trace through the scheduling policies and compare them",
    "ci": "CI verdict as exit code: a spec's cheap stages here, or the ci-canary deployment on --commit",
    "cost": "spend, idle share, time lost to failures, cost per successful run per experiment",
    "retrain": "retrain on the newest data snapshot; the new model takes @champion only if better",
    "server": "the local Prefect server traingate keeps for later commands: start, status, stop",
}
# Commands whose module imports Prefect: the kept server is chosen before that import (Prefect reads its
# settings at import). `run` and `sweep` choose it themselves, after the spec is validated.
PREFECT_AT_IMPORT = ("resume", "retrain")


def _embedded_defaults(settings: Settings) -> None:
    """Keep Prefect's home inside the state dir, its telemetry off and its temporary server authenticated
    (set before importing prefect)."""
    os.environ.setdefault("PREFECT_HOME", str(settings.state_dir / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    # The logs a command's flow sends to the server go in batches; the last one is delivered as the command ends,
    # and with Prefect's 2 s interval it can hold 2 s of a stage's output (30 ms of the server's time to store).
    os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.25")
    # The temporary server's 20 s default is too tight on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    local_server.authenticate_temporary()  # a temporary server, when one starts, demands an auth string


def _parser() -> argparse.ArgumentParser:
    """The argument parser: every command's arguments, none of their modules imported."""
    p = argparse.ArgumentParser(prog="traingate", description="staged model training on Prefect")
    p.add_argument("--version", action="version", version=f"traingate {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_text in COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        getattr(arguments, name)(command)
        arguments.verbose(command)
    return p


def _version() -> str:
    """The installed distribution's version: the one pip, the image and `traingate --version` agree on."""

    try:
        return version("traingate")
    except PackageNotFoundError:  # a source checkout that was never installed (pip install -e .)
        return "unknown (not installed: pip install -e .)"


def run(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (the process's arguments when None: the `traingate` process itself) here."""
    _embedded_defaults(Settings.from_env())  # before anything imports prefect
    logsafety.install()  # before anything logs: Prefect's API log handler stores what it is given
    args = _parser().parse_args(argv)
    with console.session(args.cmd, Settings.from_env(), args.verbose):  # the terminal: traingate's lines
        code = _command(args)
    if argv is None and args.cmd in cli_forward.COMMANDS:
        cli_engine.ensure(Settings.from_env().state_dir)  # the next such command on the kept server is forked
    if argv is None:  # the `traingate` process itself, which ends with this return
        # Its exit collects every object of the libraries it loaded (Prefect, MLflow, pandas): 4-15 s on a loaded
        # 2-core box. Frozen, the collector skips them and the process ends in a fraction of a second.
        gc.freeze()
    return code


def _command(args: argparse.Namespace) -> int:
    try:
        move_tracking_credentials()  # the tracking URI is written everywhere; MLflow's credential variables are not
        if args.cmd in PREFECT_AT_IMPORT:
            local_server.connect(Settings.from_env().state_dir)
        # lazy: a command's module imports Prefect, MLflow or torch; only the command that runs pays for it
        return int(importlib.import_module(f"flows.cli.{args.cmd}").main(args))
    except local_server.LocalServerError as e:
        print(f"traingate: {e}", file=sys.stderr)
        return EXIT_SPEC
    except SpecError as e:
        # One line, whatever a message quoted: the promise is a line a script can grep.
        print(f"traingate: invalid spec: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return EXIT_SPEC
