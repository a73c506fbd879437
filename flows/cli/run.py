"""`traingate run SPEC`: the plan, then the ladder in this process (its progress followed), and a summary.

Also what `ci` and `resume` share with it: the ladder started here in a guarded process (Ctrl-C preempts
the running stage at a checkpoint; a second Ctrl-C aborts with the resume command).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from flows import local_server
from flows.cli import console
from flows.cli.terminal import follow_run
from flows.cli.validate import _load
from traingate.job.envvars import omp_threads_note
from traingate.ladder.plan import plan, render
from traingate.recipes.script import interpreter_note
from traingate.redact import redact
from traingate.secrets import protect_spec
from traingate.settings import Settings
from traingate.supervision import guardian, supervisor
from traingate.tracking import stale
from traingate.tracking.prior import latest_canary_profile
from traingate.units import usd


def main(args: argparse.Namespace) -> int:
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
    _say_what_a_script_runs_with(spec)
    if args.dry_run:
        return 0
    # A progress bar in a terminal, one line per stage transition elsewhere.
    local_server.connect(settings.state_dir)  # the kept server, once the spec passed (flows.local_server)
    state = run_ladder_here(spec, args.until, settings, follow=follow_run, checked=True)
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
                f"mlflow run {info['mlflow_run_id']}  {usd(info['cost_usd'])}"
            )
        if summary.get("checkpoint_uri"):
            print(f"  checkpoint:      {redact(summary['checkpoint_uri'])}")
        model = summary.get("model") or {}
        if model.get("registered"):  # a refusal, with its fix, is in the headline above (flows.pipeline)
            print(f"  model:           models:/{model['name']}@{model['alias']} (version {model['version']})")
        print(f"  prefect flow run: {summary['flow_run_id']}")
        print(f"  stage outputs:   {summary['run_dir']}")
    if console.log_path() is not None:
        print(f"  log (-v shows it here): {console.log_path()}")
    print(f"  MLflow UI:  mlflow ui --backend-store-uri {redact(settings.tracking_uri)}")
    print(f"  Prefect UI: {local_server.ui_hint(settings.state_dir)}")
    return 0 if state.is_completed() else 1


def run_ladder_here(
    spec: Any,
    until: str,
    settings: Settings,
    follow: Callable[[Settings], AbstractContextManager[Any]] | None = None,
    checked: bool = False,
) -> Any:
    """The ladder flow in this process, as `run` and `ci` start it: the state dir made, the process
    guarded (Ctrl-C preempts at a checkpoint), ``follow(settings)`` around the flow when given. ``checked``: the
    caller resolved the spec's newest data, checked it and ran the preflight (:func:`flows.cli.validate._load`).

    Returns the flow's final state, or the exit code of a second Ctrl-C (no waiting for the checkpoint).
    """
    # lazy: importing Prefect creates PREFECT_HOME; a refused spec leaves nothing behind
    from flows.pipeline import check_entitled, checked_here, ladder, no_flow_heartbeats, one_client

    named = bool(os.environ.get("PREFECT_API_URL"))  # else the temporary server starts below
    with one_client() if named else contextlib.nullcontext():
        if named:  # a server that may carry a Slurm pool (a temporary one carries none)
            check_entitled(spec)
            if checked:  # the ladder finds it checked: nothing is asked twice
                checked_here(spec)
        settings.ensure()
        guard_this_process(spec.supervision.preempt_grace_s)
        try:
            with follow(settings) if follow is not None else contextlib.nullcontext(), no_flow_heartbeats():
                return ladder(spec, until, return_state=True)
        except KeyboardInterrupt:
            return interrupted(_claimed_run(settings))
        finally:
            if (claimed := _claimed_run(settings)) is not None:  # a follower may have attached it already
                console.attach(settings.state_dir / "runs" / claimed)


def _say_what_a_script_runs_with(spec: Any) -> None:
    """With the plan, what traingate chooses for a script that the script's own command does not show: the
    interpreter its ``python`` runs, and OMP_NUM_THREADS when traingate sets it (docs/scripts.md)."""
    if spec.recipe.script is None:
        return
    for note in (interpreter_note(spec, sys.executable), omp_threads_note()):
        if note is not None:
            print(f"traingate: {note}", flush=True)


def guard_this_process(grace_s: float) -> None:
    """Nothing this process starts outlives it, and Ctrl-C preempts the running stage at a checkpoint.

    A guardian process stops the temporary Prefect server and any process tree if this process is
    killed (traingate.supervision.guardian). The first Ctrl-C asks every supervised tree to write its
    emergency checkpoint and stop, so the flow ends Cancelled with the resume command; a second one aborts.
    """
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
    """The run this process was orchestrating in ``settings``' state directory: the one it claimed last that
    still names it as its orchestrator (the ladder records it as it starts, traingate.tracking.stale.claim)."""
    run_dir = stale.claimed_here()
    return run_dir.name if run_dir is not None and run_dir.parent == settings.state_dir / "runs" else None


def _start_prefect_server_shielded() -> None:
    """Start Prefect's temporary server now (when no PREFECT_API_URL names one) with SIGINT blocked.

    A terminal's Ctrl-C goes to the whole foreground process group, and Prefect starts its temporary
    server in ours: it died of the first Ctrl-C, and the run it was recording ended in connection
    errors and a traceback instead of a Cancelled state with the resume command. A blocked signal
    stays blocked across fork and exec, so the server never sees it; it still stops with this process
    (SIGTERM at exit, the guardian if this process is killed).
    """
    # lazy: importing Prefect creates PREFECT_HOME; a refused spec leaves nothing behind
    from prefect import get_client, settings

    if settings.PREFECT_API_URL.value():
        return  # a named server (the kept one, or the user's): nothing starts here
    # A new database of the temporary server is a copy of a cached, migrated one (flows.local_server).
    db_url = settings.PREFECT_API_DATABASE_CONNECTION_URL.value() or ""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with local_server.temporary_server_start(db_url, Settings.from_env().state_dir), get_client(sync_client=True):
            pass  # starts the temporary server here, in this thread, if one is used
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _summary(state: Any) -> dict[str, Any] | None:
    # lazy: importing Prefect creates PREFECT_HOME; a refused spec leaves nothing behind
    from flows.pipeline import summary_of

    return summary_of(state)
