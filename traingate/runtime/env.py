"""What the orchestrator hands a training process: identity and locations, as environment variables.

The same variables reach a user's own script (the ``script`` recipe), so a script
that uses MLflow logs into the same run and writes checkpoints where we look.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

RUN_ID = "TRAINGATE_RUN_ID"
STAGE = "TRAINGATE_STAGE"
OUT_DIR = "TRAINGATE_STAGE_DIR"
CHECKPOINT_URI = "TRAINGATE_CHECKPOINT_DIR"
LAUNCH_TS = "TRAINGATE_LAUNCH_TS"
RECORD_SAMPLES = "TRAINGATE_RECORD_SAMPLES"
FAULT = "TRAINGATE_FAULT"  # "<phase>@<step>": kill this process at that checkpoint phase (tests, drills)


@dataclass(frozen=True)
class RuntimeEnv:
    run_id: str
    stage: str
    out_dir: Path
    checkpoint_uri: str
    tracking_uri: str | None
    mlflow_run_id: str | None
    launch_ts: float | None
    record_samples: bool
    fault: str | None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "RuntimeEnv":
        env = os.environ if env is None else env
        out = Path(env.get(OUT_DIR, "./traingate-stage")).resolve()
        return cls(
            run_id=env.get(RUN_ID, "local"),
            stage=env.get(STAGE, "full"),
            out_dir=out,
            checkpoint_uri=env.get(CHECKPOINT_URI) or (out / "checkpoints").as_uri(),
            tracking_uri=env.get("MLFLOW_TRACKING_URI"),
            mlflow_run_id=env.get("MLFLOW_RUN_ID"),
            launch_ts=float(env[LAUNCH_TS]) if env.get(LAUNCH_TS) else None,
            record_samples=env.get(RECORD_SAMPLES, "") == "1",
            fault=env.get(FAULT) or None,
        )

    def record_samples_path(self, rank: int) -> Path:
        return self.out_dir / f"samples.rank{rank}.txt"

    def fault_hook(self) -> Callable[[str, int], None] | None:
        """A hook that SIGKILLs this process at ``phase`` of the save of ``step`` (TRAINGATE_FAULT)."""
        if not self.fault:
            return None
        phase, _, at = self.fault.partition("@")
        at_step = int(at) if at else None

        def hook(p: str, step: int) -> None:
            if p == phase and (at_step is None or step == at_step):
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
        return hook
