"""`traingate sweep SPEC [--set k=v ...] [--promote]`: run (or resume) the spec's hyperparameter sweep."""

from __future__ import annotations

import argparse

from flows import local_server
from flows.cli.run import guard_this_process
from traingate.ladder.sweep_preflight import check_sweep
from traingate.redact import redact
from traingate.secrets import protect_spec
from traingate.settings import Settings
from traingate.snapshots import resolve_spec
from traingate.spec import load_spec


def main(args: argparse.Namespace) -> int:
    spec = resolve_spec(load_spec(args.spec, args.overrides))  # data.uri's {latest}: the version of now
    check_sweep(spec)  # every error before Prefect starts
    spec = protect_spec(spec)  # the flow-run parameters hold ${env:} references, not secrets
    settings = Settings.from_env().ensure()

    local_server.connect(settings.state_dir)  # the kept server, once the spec passed (flows.local_server)
    guard_this_process(spec.supervision.preempt_grace_s)

    # lazy: importing Prefect creates PREFECT_HOME; a refused spec leaves nothing behind
    from flows import pipeline, sweep

    with pipeline.no_flow_heartbeats():  # its trials' flow runs too: this process's liveness is the guardian's
        state = sweep.sweep(spec, args.promote, return_state=True)
    data = state.result(raise_on_failure=False)
    print(f"sweep {'DONE' if state.is_completed() else 'STOPPED'}: {state.message}")
    if isinstance(data, dict):
        for k in (
            "study",
            "stop_reason",
            "trials_finished",
            "total_steps",
            "best_trial",
            "best_value",
            "best_params",
            "reproducibility",
            "best_spec",
            "parent_run_id",
            "promotion",
        ):
            if k in data:
                print(redact(f"  {k:<16} {data[k]}"))
        for p in data.get("plots", []):
            print(f"  plot             {p}")
    # A PostgreSQL storage or a tracking server URL may carry a password: the terminal gets it masked.
    print(f"  optuna-dashboard {redact(settings.optuna_storage)}")
    print(f"  MLflow UI:  mlflow ui --backend-store-uri {redact(settings.tracking_uri)}")
    print(f"  Prefect UI: {local_server.ui_hint(settings.state_dir)}")
    return 0 if state.is_completed() else 1
