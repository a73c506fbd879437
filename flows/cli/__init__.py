"""The `traingate` command: one module per command group in this package.

    traingate validate SPEC [--set k=v ...] [--pools F] print the resolved spec
    traingate run SPEC [--set k=v ...] [--until STAGE] [--dry-run]
    traingate COMMAND --help                           every other command (see COMMANDS)

A spec error prints one line naming the field, the value and the fix, exits 2,
and starts nothing: validation runs before Prefect or MLflow is touched.
"""

from __future__ import annotations

import importlib
import sys

from flows import cli_forward


def main(argv: list[str] | None = None) -> int:
    """`traingate ARGV...` (the process's own arguments when ``argv`` is None)."""
    if argv is None and (forked := cli_forward.forward(sys.argv[1:])) is not None:
        return forked  # run by the kept server's engine (flows.cli_engine)
    # imported here, not above: a command the engine runs never pays for the command table's imports
    return int(importlib.import_module("flows.cli.command").run(argv))
