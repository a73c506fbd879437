"""Prefect artifact boundary: a training stage's live progress in the UI.

One progress artifact per run and stage (``tg-<run>-<n>-<stage>-progress``), created when the stage
starts and updated in place while it trains: the percentage of steps done, and a description with the
steps, the latest loss, the ETA, the run's spend so far and a link to the stage's MLflow run. The
values are read from the stage directory (:mod:`traingate.monitor.progress`), never from the
training process, which knows nothing of Prefect.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import cast
from uuid import UUID

import httpx
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.report import artifact_key
from traingate.job.stagejob import JobKind, StageJob
from traingate.monitor.dashboard import RunReader
from traingate.monitor.progress import stage_progress
from traingate.tracking.standard import run_link

PROGRESS_EVERY_S = 2.0  # the UI polls about this often; a shorter stage still gets its first and last update

log = logging.getLogger(__name__)


def progress_key(run_id: str, stage: str) -> str:
    """The stage's progress artifact key, beside its report's.

    >>> progress_key("7d1e0b2a", "canary")
    'tg-7d1e0b2a-3-canary-progress'
    """
    return f"{artifact_key(run_id, stage)}-progress"


class ProgressArtifact:
    """The stage's progress artifact. ``tick`` (called every supervisor tick) publishes at most every
    ``every_s`` seconds; ``publish`` at once (the stage's end). A ladder stage's only: a sweep trial's
    progress is its Optuna reports and the sweep's own artifact, a drill has no UI."""

    def __init__(self, job: StageJob, every_s: float = PROGRESS_EVERY_S):
        self.stage, self.every_s = job.stage, every_s
        self.enabled = job.kind == JobKind.LADDER
        self.reader = RunReader(Path(job.run_dir), experiment=job.spec.identity.experiment)
        self.key = progress_key(job.run_id, job.stage)
        self.link = run_link(job.tracking_uri, job.mlflow_run_id) if job.tracking_uri and job.mlflow_run_id else ""
        self.artifact_id: UUID | None = None
        self.last = float("-inf")
        self.unreachable = False

    def tick(self) -> None:
        if time.monotonic() - self.last >= self.every_s:
            self.publish()

    def publish(self) -> float | None:
        """Create or update the artifact from the stage directory as it is now; returns the percentage
        published (None: not a ladder stage, or the Prefect API did not take it: training goes on, one
        warning says so)."""
        if not self.enabled:
            return None
        self.last = time.monotonic()
        p = stage_progress(self.reader.snapshot(), self.stage, self.link)
        try:
            # _sync: Prefect's dispatch would hand back a coroutine when this thread has an event loop.
            if self.artifact_id is None:
                made = create_progress_artifact(p.percent, key=self.key, description=p.text, _sync=True)  # type: ignore[call-arg]
                self.artifact_id = cast(UUID, made)
            else:
                update_progress_artifact(self.artifact_id, p.percent, description=p.text, _sync=True)  # type: ignore[call-arg]
        except httpx.HTTPError as e:  # the UI's view of the stage, never a reason to stop it
            if not self.unreachable:
                log.warning("%s: progress artifact not updated (%s); the stage trains on", self.stage, e)
            self.unreachable = True
            return None
        self.unreachable = False
        return p.percent
