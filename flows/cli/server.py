"""`traingate server start|status|stop`: the local Prefect server traingate keeps for later commands
(flows.local_server). The auth string stays in its 0600 file; only the file's path is printed."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import psutil

from flows import cli_engine, local_server
from traingate.settings import Settings


def main(args: argparse.Namespace) -> int:
    state_dir = Settings.from_env().state_dir
    d = local_server.server_dir(state_dir)
    if args.action == "start":
        kept, started = local_server.ensure(state_dir)
        print(f"{'started' if started else 'already running'}: {_describe(kept, d)}")
        return 0
    if args.action == "status":
        running = local_server.status(state_dir)
        if running is None:
            print(f"not running (state in {d}); `traingate server start` starts it")
            return 1
        print(f"running: {_describe(running, d)}")
        return 0
    cli_engine.stop(state_dir)  # the engine forking commands for this server (it ends with the server too)
    stopped = local_server.stop(state_dir)
    print(f"stopped (pid {stopped.pid})" if stopped else "not running")
    return 0


def _describe(record: local_server.Record, d: Path) -> str:
    up = time.time() - psutil.Process(record.pid).create_time()
    return (
        f"{record.ui_url} (API {record.api_url}), pid {record.pid}, up {up:.0f} s; "
        f"auth string in {d}/{local_server.SECRETS}; log {d}/{local_server.LOG}"
    )
