"""Where things live. Every location is a URI derived from one settings object.

Settings come from environment variables with the ``TRAINGATE_`` prefix; nothing
else in the project hard-codes a path. The embedded defaults put everything under
one state directory (``./.traingate`` unless ``TRAINGATE_STATE_DIR`` says otherwise).

>>> s = Settings.from_env({"TRAINGATE_STATE_DIR": "/tmp/tg"})
>>> s.tracking_uri
'sqlite:////tmp/tg/mlflow.db'
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


TRACKING_URI_VAR = "TRAINGATE_TRACKING_URI"
IMAGE_VAR = "TRAINGATE_IMAGE"  # the pinned training image of container pools (`traingate pools bootstrap`)


@dataclass(frozen=True)
class Settings:
    state_dir: Path
    tracking_uri: str
    artifact_uri: str
    checkpoint_uri: str
    optuna_storage: str
    s3_endpoint_url: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        state = Path(env.get("TRAINGATE_STATE_DIR", ".traingate")).expanduser().resolve()
        return cls(
            state_dir=state,
            tracking_uri=env.get(TRACKING_URI_VAR, f"sqlite:///{state}/mlflow.db"),
            artifact_uri=env.get("TRAINGATE_ARTIFACT_URI", (state / "mlartifacts").as_uri()),
            checkpoint_uri=env.get("TRAINGATE_CHECKPOINT_URI", (state / "checkpoints").as_uri()),
            optuna_storage=env.get("TRAINGATE_OPTUNA_STORAGE", f"sqlite:///{state}/optuna.db"),
            s3_endpoint_url=env.get("TRAINGATE_S3_ENDPOINT_URL") or None,
        )

    def ensure(self) -> "Settings":
        self.state_dir.mkdir(parents=True, exist_ok=True)
        return self
