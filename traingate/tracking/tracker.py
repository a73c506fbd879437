"""The tracker a training process logs through.

Rank 0 gets an :class:`MlflowTracker` that batches metrics and writes them from a
background thread with ``log_batch``, so a step never waits on the tracking store.
Every other rank gets the :class:`NullTracker`, built once.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class NullTracker:
    """What non-logging ranks (and runs with tracking disabled) get."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_dict(self, data: dict, artifact_file: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class MlflowTracker(NullTracker):
    """Buffered writer into an existing MLflow run (the run is created by the orchestrator)."""

    def __init__(self, tracking_uri: str, run_id: str, flush_every_s: float = 1.0, max_batch: int = 900):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id
        self.flush_every_s, self.max_batch = flush_every_s, max_batch
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._flushed = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tracker", daemon=True)
        self._thread.start()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        with self._flushed:
            self._pending += len(metrics)
        for k, v in metrics.items():
            self._q.put(Metric(k, float(v), ts, step))

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    def _drain(self) -> list:
        batch = []
        while len(batch) < self.max_batch:
            try:
                batch.append(self._q.get_nowait())
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.flush_every_s)
            while batch := self._drain():
                try:
                    self.client.log_batch(self.run_id, metrics=batch)
                except Exception as e:  # noqa: BLE001 - surfaced to the training thread on flush()
                    self._error = e
                    log.error("tracker: log_batch failed (%s); %d metrics not written", e, len(batch))
                with self._flushed:
                    self._pending -= len(batch)
                    self._flushed.notify_all()
            if stopping:
                return

    def flush(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self._flushed:
            while self._pending > 0 and time.monotonic() < deadline:
                self._flushed.wait(0.1)
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"tracking store rejected metrics: {err}") from err

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        if self._error is not None:
            raise RuntimeError(f"tracking store rejected metrics: {self._error}")


def make_tracker(rank: int, enabled: bool, tracking_uri: str | None, run_id: str | None) -> NullTracker:
    if rank != 0 or not enabled or not tracking_uri or not run_id:
        return NullTracker()
    return MlflowTracker(tracking_uri, run_id)
