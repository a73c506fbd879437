"""Run a tiny digits stage under the real supervisor (real torchrun, gloo, CPU) with injected faults."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

from traingate.job.stagejob import derive
from traingate.runtime import inject
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision.supervisor import Hooks, Supervision, supervise

# Fast restarts, a short hang timeout, no MLflow: these tests are about the process tree.
SUPERVISED = """
tracking: {enabled: false, log_every: 2}
supervision: {backoff_base_s: 0.2, backoff_max_s: 1.0, hang_timeout_s: 4, preempt_grace_s: 20}
"""


class Run:
    def __init__(self, sup: Supervision, stage_dir: Path, seconds: float, events: list[dict[str, Any]],
                 log: list[str], exits: list[int]):
        self.sup, self.stage_dir, self.seconds, self.events, self.log = sup, stage_dir, seconds, events, log
        self.exits = exits  # at each launch's end (Hooks.on_exit): how many restarts had been announced

    @property
    def causes(self) -> list[str | None]:
        return [a.cause for a in self.sup.attempts]

    def fired(self) -> list[dict[str, Any]]:
        return inject.fired(self.stage_dir)


@pytest.fixture
def supervised(tiny_spec, state_dir, tmp_path) -> Callable[..., Run]:
    """supervised("kill@7:1", "optim.lr=1") -> Run: the full stage (2 ranks, 16 steps, checkpoint every 5)."""
    def run(faults: str = "", *overrides: str, stage: str = "full", name: str = "run") -> Run:
        spec = load_spec(tiny_spec(SUPERVISED, name=f"{name}.yaml"), list(overrides))
        job = derive(spec, stage, run_id=name, run_dir=tmp_path / name, settings=Settings.from_env(),
                     faults=faults or None)
        events: list[dict[str, Any]] = []
        log: list[str] = []
        t0 = time.monotonic()
        exits: list[int] = []
        hooks = Hooks(info=log.append, on_restart=events.append, on_exit=lambda: exits.append(len(events)))
        sup = supervise(job, hooks=hooks, seed=0)
        assert job.checkpoint_uri.startswith("file://")
        return Run(sup, Path(job.stage_dir), time.monotonic() - t0, events, log, exits)
    return run
