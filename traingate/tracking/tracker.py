"""The tracker a training process logs through.

Rank 0 gets an :class:`MlflowTracker`: every record is appended to a local journal
(:mod:`traingate.tracking.journal`) and a :class:`Delivery` thread delivers the journal to
MLflow with ``log_batch``, so a step never waits on the tracking store, an outage of
the store costs disk, not memory, and nothing is lost. Every other rank gets the
:class:`NullTracker`, built once.

Under the supervisor the delivery runs in the supervisor's process instead
(``StageJob.tracking_delivery == "supervisor"``): the training process only appends to the
journal and never imports MLflow, which takes seconds of CPU from every launch (a smoke
stage launches twice) on the machine that trains. A process launched by hand delivers its own.

One logical run spans process lifetimes: the process of a restarted stage writes into
the same MLflow run (``MLFLOW_RUN_ID``), replays what its predecessor left undelivered,
records the restart (count, cause, step resumed from, time lost) and skips the steps
its predecessor already logged, so every step is in the metric history exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from traingate.job import envvars
from traingate.job.vocab import Status
from traingate.redact import redact
from traingate.secrets import resolve
from traingate.tracking.compat_mlflow import latest_metrics
from traingate.tracking.journal import History, Journal
from traingate.tracking.restarts import restart_message

log = logging.getLogger(__name__)


# MLflow's log_batch limits per request.
_MAX_METRICS, _MAX_TAGS = 1000, 100
_TAG_LIMIT = 8000
# Errors after which retrying cannot help: the record is dropped and close() raises.
_PERMANENT = {
    "INVALID_PARAMETER_VALUE",
    "RESOURCE_DOES_NOT_EXIST",
    "INVALID_STATE",
    "BAD_REQUEST",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
}


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

    def start_session(self, resumed_from_step: int, restart_cause: str | None = None) -> None:
        pass

    def end_session(self, status: str) -> None:
        pass

    def flush(self, timeout_s: float = 60.0) -> None:
        pass

    def close(self) -> None:
        pass


def _now_ms() -> int:
    return int(time.time() * 1000)


def _fail_fast_http() -> None:
    # MLflow's REST client retries a refused connection for minutes by default. The writer
    # thread has its own retry loop over the journal, so one quick attempt per round is right.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def _mlflow() -> Any:
    """The mlflow package with its client, entities and exceptions loaded."""
    # lazy: MLflow takes seconds to import; only rank 0's writer uses it, and imports it in its own thread
    import mlflow.tracking

    return mlflow


def _transient_errors() -> tuple[type[BaseException], ...]:
    # lazy: SQLAlchemy takes 0.5 s to import; MLflow loads it anyway (its SQL stores), after _mlflow()
    import sqlalchemy.exc

    # requests' errors (the REST store's) are OSErrors: importing requests would cost every rank ~0.1 s of CPU.
    return _mlflow().exceptions.MlflowException, OSError, sqlalchemy.exc.SQLAlchemyError


class MlflowTracker(NullTracker):
    """Journaled writer into an existing MLflow run (created by the orchestrator); ``deliver``: run the
    delivery thread here (a process on its own), else only journal (the supervisor delivers)."""

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        journal_dir: str | Path,
        flush_every_s: float = 1.0,
        drain_timeout_s: float | None = None,
        deliver: bool = True,
    ):
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.journal = Journal(Path(journal_dir) / "journal.jsonl")
        self.history: History = self.journal.history()
        self._high_water = dict(self.history.high_water)
        self.dropped_duplicates = 0
        self.delivery = (
            Delivery(tracking_uri, run_id, self.journal, flush_every_s, drain_timeout_s) if deliver else None
        )
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self.delivery is not None:
            return self.delivery.client
        if self._client is None:  # only journaling: MLflow is needed only to learn a lost journal's past
            _fail_fast_http()
            self._client = _mlflow().tracking.MlflowClient(self.tracking_uri)
        return self._client

    # ------------------------------------------------------------ the training thread's side
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = _now_ms()
        records = []
        for k, v in metrics.items():
            # A resumed process redoes the steps after its checkpoint; they are logged already.
            if step <= self._high_water.get(k, -1):
                self.dropped_duplicates += 1
                continue
            self._high_water[k] = step
            records.append({"m": k, "v": float(v), "s": step, "t": ts})
        if records:
            self.journal.append(records)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.journal.append([{"tag": k, "v": redact(str(v))[:_TAG_LIMIT]} for k, v in tags.items()])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.journal.append([{"text": artifact_file, "v": redact(text)}])

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self.log_text(json.dumps(data, indent=1, sort_keys=True, default=str), artifact_file)

    def start_session(self, resumed_from_step: int, restart_cause: str | None = None) -> None:
        """Record this process lifetime; if it is a restart, record cause (``restart_cause``, from the
        StageJob, else how the previous process ended, else unknown), step resumed from and time lost."""
        h = self.history
        prior = len(h.sessions)
        if prior == 0 and resumed_from_step > 0:
            prior = self._learn_from_store()
        now = _now_ms()
        n = prior + 1
        session: dict[str, Any] = {
            "session": n,
            "t": now,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "resumed_from": resumed_from_step,
        }
        tags = {
            "traingate.sessions": str(n),
            "traingate.restarts": str(n - 1),
            "traingate.host.rank0": socket.gethostname(),
        }
        metrics: dict[str, float] = {}
        if n > 1:
            cause = str(restart_cause or (h.ended["end"] if h.ended else "unknown"))
            # A process that ended paused or preempted at its emergency checkpoint left on purpose: the
            # wait until someone resumed it is not lost, only the work after the step resumed from.
            paused = h.ended is not None and h.ended.get("end") == Status.PREEMPTED and h.ended.get("t")
            until = int(h.ended["t"]) if paused and h.ended is not None else now
            lost = round(max(0.0, until - self._reached_ms(resumed_from_step)) / 1000, 3)
            total_lost = round(sum(s.get("time_lost_s", 0.0) for s in h.sessions) + lost, 3)
            session.update(cause=cause, time_lost_s=lost)
            r = n - 1
            tags.update(
                {
                    f"traingate.restart.{r}.cause": cause,
                    f"traingate.restart.{r}.resumed_from_step": str(resumed_from_step),
                    f"traingate.restart.{r}.time_lost_s": str(lost),
                    f"traingate.restart.{r}.time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now / 1000)),
                    "traingate.time_lost_s": str(total_lost),
                }
            )
            metrics = {"restart.resumed_from_step": float(resumed_from_step), "restart.time_lost_s": lost}
            log.log(*restart_message(r, cause, resumed_from_step, lost))
        self.journal.append([session])
        self.set_tags(tags)
        if metrics:
            self.log_metrics(metrics, step=n - 1)

    def _reached_ms(self, step: int) -> int:
        """When this run first reached ``step``: the newest record at or before it."""
        h = self.history
        before = [t for s, t in h.step_times_ms.items() if s <= step]
        if before:
            return max(before)
        return h.sessions[0]["t"] if h.sessions else _now_ms()

    def _learn_from_store(self) -> int:
        """No local journal but a checkpoint to resume from: ask MLflow what earlier processes logged."""
        try:
            run = self.client.get_run(self.run_id)
        except _transient_errors() as e:
            log.warning(
                "tracking store unreachable at resume (%s); restart count and logged steps "
                "are taken from the local journal only",
                str(e).splitlines()[0][:200],
            )
            return 0
        for m in latest_metrics(run):  # latest value per key, whose step is the key's highest
            self._high_water[m.key] = max(self._high_water.get(m.key, -1), m.step)
        return int(run.data.tags.get("traingate.sessions", "0"))

    def end_session(self, status: str) -> None:
        self.journal.append([{"end": status, "t": _now_ms()}])

    def flush(self, timeout_s: float = 60.0) -> None:
        if self.delivery is not None:
            self.delivery.flush(timeout_s)

    def close(self) -> None:
        if self.delivery is not None:
            self.delivery.close()  # closes the journal too
        else:
            self.journal.close()


class Delivery:
    """Delivers a journal to its MLflow run from a background thread, in order, retrying through
    outages; commits the delivered offset. Used by a tracker in its own process, or by the
    supervisor for the stage it runs (the journal then has its writer in another process)."""

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        journal: Journal | Path,
        flush_every_s: float = 1.0,
        drain_timeout_s: float | None = None,
        until_records: bool = False,
    ):
        _fail_fast_http()
        self.until_records = until_records
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self.journal = journal if isinstance(journal, Journal) else Journal(Path(journal))
        self.flush_every_s = flush_every_s
        self.drain_timeout_s = envvars.tracking_drain_s() if drain_timeout_s is None else drain_timeout_s
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._transient: tuple[type[BaseException], ...] = (OSError,)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._error: BaseException | None = None
        self._outage_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="tracker", daemon=True)
        self._thread.start()

    @property
    def client(self) -> Any:
        """The MLflow client, built on first use. The thread builds it as soon as it starts (``until_records``:
        once there is something to deliver): importing MLflow and opening its store (engine, schema check) then
        overlaps with everything else."""
        with self._client_lock:
            if self._client is None:
                self._transient = _transient_errors()
                self._client = _mlflow().tracking.MlflowClient(self.tracking_uri)
            return self._client

    def _run(self) -> None:
        backoff = 0.0
        try:
            # ``until_records``: a supervisor delivering for the ranks it starts. MLflow's import and its store's
            # set-up take seconds of CPU on the node that trains, where the ranks are importing torch and joining
            # their group; the ranks' first records come with the first training step.
            while self.until_records and not self._stop.is_set() and self.journal.pending_bytes() == 0:
                self._wake.wait(self.flush_every_s)
                self._wake.clear()
            if self.until_records and self.journal.pending_bytes() == 0:
                return  # closed with nothing to deliver
            try:
                self.client  # noqa: B018 - build it now, off the caller's thread
            except self._transient as e:
                log.warning(
                    "tracking store unreachable at start (%s); buffering in %s",
                    str(e).splitlines()[0][:200],
                    self.journal.path,
                )
            while not self._stop.is_set():
                self._wake.wait(backoff or self.flush_every_s)
                self._wake.clear()
                backoff = 0.0 if self._deliver() else min(max(0.5, 2 * backoff), 5.0)
            deadline = time.monotonic() + self.drain_timeout_s
            while not self._deliver() and time.monotonic() < deadline:
                time.sleep(min(max(0.5, 2 * backoff), 5.0, max(0.0, deadline - time.monotonic())))
        except BaseException as e:  # noqa: BLE001 - a bug in delivery: surfaced by flush()/close()
            self._error = e
            raise

    def _deliver(self) -> bool:
        """Send everything pending, in order. False on a transient failure (the records stay pending)."""
        while True:
            pending = self.journal.read_pending(_MAX_METRICS)
            if not pending:
                if self._outage_since is not None:
                    log.warning(
                        "tracking store reachable again after %.0f s; journal replayed",
                        time.monotonic() - self._outage_since,
                    )
                    self._outage_since = None
                return True
            for group, end in _groups(pending):
                try:
                    self._send(group)
                except self._transient as e:
                    if getattr(e, "error_code", None) not in _PERMANENT:
                        if self._outage_since is None:
                            self._outage_since = time.monotonic()
                            log.warning(
                                "tracking store unreachable (%s); buffering in %s",
                                str(e).splitlines()[0][:200],
                                self.journal.path,
                            )
                        return False
                    self._error = e
                    log.error("tracking store rejected %d records: %s", len(group), e)
                self.journal.commit(end)

    def _send(self, group: list[dict[str, Any]]) -> None:
        Metric, RunTag = _mlflow().entities.Metric, _mlflow().entities.RunTag
        if not group:
            return
        first = group[0]
        if "text" in first:
            self.client.log_text(self.run_id, first["v"], first["text"])
            return
        metrics = [Metric(r["m"], r["v"], r["t"], r["s"]) for r in group if "m" in r]
        tags = {r["tag"]: r["v"] for r in group if "tag" in r}
        if metrics or tags:
            self.client.log_batch(self.run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait (up to ``timeout_s``) until the journal is delivered."""
        deadline = time.monotonic() + timeout_s
        while self.journal.pending_bytes() > 0 and time.monotonic() < deadline and self._thread.is_alive():
            self._wake.set()
            time.sleep(0.05)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"tracking store rejected records: {err}") from err

    def close(self) -> None:
        """Deliver what is pending (up to the drain timeout); what is left stays in the journal for replay."""
        self._stop.set()
        self._wake.set()
        self._thread.join()
        left = self.journal.pending_bytes()
        self.journal.close()
        if left:
            log.warning(
                "tracking store still unreachable after %.0f s: %d bytes of records stay in %s and are "
                "replayed by the next process of this stage",
                self.drain_timeout_s,
                left,
                self.journal.path,
            )
        self._raise_if_failed()


def _groups(pending: list[tuple[dict[str, Any], int]]):
    """Split pending records into log_batch-sized groups (artifacts alone), with the offset after each."""
    group: list[dict[str, Any]] = []
    n_tags = 0
    end = 0
    for rec, off in pending:
        if "session" in rec or "end" in rec:
            end = off
            continue
        if "text" in rec or n_tags >= _MAX_TAGS:
            if group:
                yield group, end
            group, n_tags = [], 0
        group.append(rec)
        n_tags += "tag" in rec
        end = off
        if "text" in rec:
            yield group, end
            group = []
    if group or end:
        yield group, end


def run_to_resume(run_id: str | None, checkpointer: Any) -> str | None:
    """The MLflow run to write into: the one handed over (MLFLOW_RUN_ID), else the one the newest
    checkpoint was written under, so a process relaunched by hand still continues its run."""
    if run_id or checkpointer is None:
        return run_id
    step = checkpointer.find_latest(verify=False)
    return checkpointer.manifest(step).get("mlflow_run_id") if step is not None else None


def make_tracker(
    rank: int,
    enabled: bool,
    tracking_uri: str | None,
    run_id: str | None,
    journal_dir: str | Path | None = None,
    deliver: bool = True,
) -> NullTracker:
    """Rank 0 with tracking on and a run to write into gets the MLflow writer; everyone else the null one.
    ``deliver`` False: journal only, the supervisor delivers."""
    if rank != 0 or not enabled or not tracking_uri or not run_id:
        return NullTracker()
    return MlflowTracker(
        resolve(tracking_uri, field="tracking URI"),
        run_id,
        journal_dir or tempfile.mkdtemp(prefix="traingate-journal-"),
        deliver=deliver,
    )
