"""Which Prefect server a command uses when no ``PREFECT_API_URL`` names one, and where the kept server's files
are: what the `traingate` command reads before it hands a command to the CLI engine (:mod:`flows.cli_forward`),
kept apart from :mod:`flows.local_server`, which starts and stops the server, so that the hand-over imports
nothing more.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path

from traingate.commandenv import PREFECT_SERVER_VAR

MODE_VAR = PREFECT_SERVER_VAR
DIR_NAME = "prefect-server"


class Mode(StrEnum):
    KEPT = "kept"
    TEMPORARY = "temporary"


class LocalServerError(RuntimeError):
    """The kept server cannot be used: one line naming what failed and where to look."""


def mode(env: Mapping[str, str] | None = None) -> Mode:
    """The ``TRAINGATE_PREFECT_SERVER`` setting; unset: ``temporary`` under CI (``CI`` set), else ``kept``.

    >>> mode({}).value, mode({"CI": "true"}).value, mode({"CI": "true", MODE_VAR: "kept"}).value
    ('kept', 'temporary', 'kept')
    """
    env = os.environ if env is None else env
    value = env.get(MODE_VAR, "").strip().lower()
    if not value:
        return Mode.TEMPORARY if env.get("CI", "").strip().lower() not in ("", "0", "false", "no") else Mode.KEPT
    try:
        return Mode(value)
    except ValueError:
        raise LocalServerError(
            f"{MODE_VAR} = {value!r}: not a server mode; use one of {[m.value for m in Mode]} "
            "(or set PREFECT_API_URL to use a server of your own)"
        ) from None


def server_dir(state_dir: Path) -> Path:
    return state_dir / DIR_NAME
