"""The `traingate` command's side of the CLI engine (:mod:`flows.cli_engine`): a command of :data:`COMMANDS` handed
to the engine of the kept server when one serves it. What it imports is all the `traingate` process loads before
the hand-over: the command's own time before its engine's fork.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from flows import server_mode
from traingate import commandenv
from traingate.runtime import handoff

COMMANDS = ("run", "resume", "sweep")
# ``off`` (or 0, false, no): every command runs cold and none starts an engine.
ENGINE_VAR = commandenv.CLI_ENGINE_VAR
RECORD = "engine.json"
_COLD = -1  # what handoff.ask returns when the command is to run here


def forward(argv: list[str]) -> int | None:
    """As the `traingate` command: the exit status of ``argv`` run by the kept server's engine, or None when it
    is to run in this process."""
    if not argv or argv[0] not in COMMANDS or os.environ.get("PREFECT_API_URL") or not wanted():
        return None
    try:
        if server_mode.mode() is not server_mode.Mode.KEPT:
            return None
    except server_mode.LocalServerError:
        return None  # the command reports the bad setting
    record = read_record(server_mode.server_dir(commandenv.state_dir()))
    if record is None:
        return None
    request = {
        "argv": argv,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "python": sys.executable,
        "code": str(commandenv.CODE_ROOT),
        "path0": sys.path[0],
    }
    code = handoff.ask(record["socket"], request, lambda: _COLD)
    return None if code == _COLD else code


def wanted() -> bool:
    """Whether commands may be handed to an engine (``TRAINGATE_CLI_ENGINE`` not off)."""
    return os.environ.get(ENGINE_VAR, "").strip().lower() not in ("off", "0", "false", "no")


def read_record(d: Path) -> dict | None:
    """The record of the engine of the kept server in ``d`` when its process runs, else None."""
    try:
        record = json.loads((d / RECORD).read_text())
        os.kill(int(record["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record
