"""What the `traingate` command reads of its environment before it hands a command to the CLI engine
(:mod:`flows.cli_forward`): the state directory, the kind of Prefect server, whether an engine may run it, and where
this code is. Standard library only: the hand-over's imports are all the `traingate` process loads before the
engine's fork (:mod:`traingate.settings` holds the rest of the settings).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

STATE_DIR_VAR = "TRAINGATE_STATE_DIR"
# which Prefect server a CLI command uses without PREFECT_API_URL (flows/local_server.py): kept | temporary
PREFECT_SERVER_VAR = "TRAINGATE_PREFECT_SERVER"
CLI_ENGINE_VAR = "TRAINGATE_CLI_ENGINE"  # off: every command runs cold (flows.cli_engine)
CODE_ROOT = Path(__file__).resolve().parent.parent  # the directory that holds traingate/, flows/ and tasks/


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``TRAINGATE_STATE_DIR``, absolute (default ``./.traingate``)."""
    env = os.environ if env is None else env
    return Path(env.get(STATE_DIR_VAR) or ".traingate").expanduser().resolve()
