"""Runs whose orchestrator died: find them and close them as crashed, with the cause.

A `traingate run` that is SIGKILLed (or whose machine dies) never closes its MLflow runs:
the pipeline run and the running stage's run stay RUNNING forever, and so does its Prefect
flow run. Its training tree notices on its own (:mod:`traingate.runtime.watchdog`) and
exits at a checkpoint; this module is the other half: every new ladder and every
`traingate resume` first closes such runs as KILLED, tagged with why.

Who runs a pipeline is recorded in the run directory (``orchestrator.json``: pid, its
start time, host and Prefect flow run id), written by the ladder as it starts or resumes.
A run is stale when that process is gone from this host (the start time guards against a
recycled pid), or when its Prefect flow run is already in a final state. A run on another
host is judged only by its flow run. A run without ``orchestrator.json`` is judged by its
stages' ``supervisor.json`` pids; with no pid recorded anywhere it is left alone: "cannot
tell" must never close a live run of a concurrent ladder.

>>> import os, tempfile; d = Path(tempfile.mkdtemp())
>>> o = claim(d, flow_run_id="f-1")
>>> read_orchestrator(d).pid == os.getpid(), gone(o)
(True, None)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from traingate.job.files import read_json, read_supervisor_state, write_json

if TYPE_CHECKING:  # the caller hands a client in: reading an orchestrator record (the dashboard) needs no MLflow
    from mlflow.tracking import MlflowClient

ORCHESTRATOR = "orchestrator.json"
# Not under "traingate.": stage runs opened later copy their parent's traingate.* tags, and a resumed
# pipeline's new stages did not crash.
CAUSE_TAG = "orchestrator.crash_cause"
# Prefect state types of a flow run that is still (or about to be) someone's work.
LIVE_FLOW_STATES = {"SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING"}
_TRAINING_STAGES = ("smoke", "canary", "full")


@dataclass
class Orchestrator:
    """The process that runs a pipeline: the ladder flow's process."""

    pid: int
    started: float  # the process's start time (psutil), so a recycled pid does not pass for it
    host: str
    flow_run_id: str | None = None


@dataclass
class StaleRun:
    mlflow_run_id: str
    run_id: str  # the traingate run id (the pipeline's MLflow run id)
    kind: str  # pipeline | stage
    stage: str | None
    cause: str
    flow_run_id: str | None


def claim(run_dir: Path, flow_run_id: str | None) -> Orchestrator:
    """Record this process as the orchestrator of the run in ``run_dir`` (a resume takes it over)."""
    me = psutil.Process()
    o = Orchestrator(pid=me.pid, started=me.create_time(), host=socket.gethostname(), flow_run_id=flow_run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / ORCHESTRATOR, asdict(o))
    _CLAIMED.append(run_dir)
    return o


_CLAIMED: list[Path] = []  # the run directories this process claimed, oldest first


def claimed_here() -> Path | None:
    """The run directory this process claimed last that still names it as its orchestrator (a `traingate resume`
    elsewhere takes a run over); None if none. Read from this process's own claims, not from every run
    directory: a state directory holds thousands of runs."""
    for run_dir in reversed(_CLAIMED):
        o = read_orchestrator(run_dir)
        if o is not None and o.pid == os.getpid():
            return run_dir
    return None


def read_orchestrator(run_dir: Path) -> Orchestrator | None:
    data = read_json(run_dir / ORCHESTRATOR)
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        return None
    return Orchestrator(
        data["pid"], float(data.get("started") or 0.0), str(data.get("host", "")), data.get("flow_run_id")
    )


def _pid_gone(pid: int, started: float | None) -> bool:
    try:
        p = psutil.Process(pid)
        # create_time is rounded differently across reads; a recycled pid starts seconds later, not ms.
        return p.status() == psutil.STATUS_ZOMBIE or (started is not None and abs(p.create_time() - started) > 1.0)
    except psutil.NoSuchProcess:
        return True


def gone(o: Orchestrator) -> str | None:
    """Why ``o`` is known to be dead on this host, or None (alive, or on another host: cannot tell by pid)."""
    if o.host != socket.gethostname():
        return None
    return f"orchestrator pid {o.pid} on {o.host} is gone" if _pid_gone(o.pid, o.started) else None


def verdict(run_dir: Path, flow_run_state: Callable[[str], str | None] | None = None) -> str | None:
    """Why the pipeline in ``run_dir`` is known to have lost its orchestrator, or None."""
    o = read_orchestrator(run_dir)
    if o is not None:
        if (why := gone(o)) is not None:
            return why
        if o.flow_run_id and flow_run_state is not None:
            state = flow_run_state(o.flow_run_id)
            if state is not None and state.upper() not in LIVE_FLOW_STATES:
                return f"its Prefect flow run {o.flow_run_id} is {state.lower()}"
        return None
    # Runs older than orchestrator.json: the supervisors of unfinished stages, if any recorded a pid.
    pids = [
        st.supervisor_pid
        for s in _TRAINING_STAGES
        if (st := read_supervisor_state(run_dir / s)) is not None and st.final is None and st.supervisor_pid
    ]
    if pids and all(_pid_gone(p, None) for p in pids):
        return f"supervisor pid {', '.join(map(str, pids))} is gone"
    return None


def find_stale(
    c: MlflowClient, state_dir: Path, flow_run_state: Callable[[str], str | None] | None = None
) -> list[StaleRun]:
    """RUNNING pipeline and stage runs of pipelines under ``state_dir`` whose orchestrator is gone."""
    exps = [e.experiment_id for e in c.search_experiments()]
    if not exps:
        return []
    running = c.search_runs(exps, "attributes.status = 'RUNNING'", max_results=5000)
    verdicts: dict[str, str | None] = {}
    out: list[StaleRun] = []
    for r in running:
        tags = r.data.tags
        kind, run_id = tags.get("traingate.kind"), tags.get("traingate.run_id")
        if kind not in ("pipeline", "stage") or not run_id:
            continue
        run_dir = state_dir / "runs" / run_id
        if run_id not in verdicts:
            verdicts[run_id] = verdict(run_dir, flow_run_state) if run_dir.is_dir() else None
        if (cause := verdicts[run_id]) is not None:
            o = read_orchestrator(run_dir)
            out.append(
                StaleRun(r.info.run_id, run_id, kind, tags.get("traingate.stage"), cause, o.flow_run_id if o else None)
            )
    return out


def close_stale(c: MlflowClient, stale: list[StaleRun]) -> None:
    """Close each stale run as KILLED, tagged with the cause (``orchestrator.crash_cause``)."""
    for s in stale:
        c.set_tag(s.mlflow_run_id, CAUSE_TAG, f"orchestrator_lost: {s.cause}")
        c.set_terminated(s.mlflow_run_id, "KILLED")


def sweep(
    c: MlflowClient, state_dir: Path, flow_run_state: Callable[[str], str | None] | None = None
) -> list[StaleRun]:
    """Find and close the stale runs under ``state_dir``; returns what was closed."""
    stale = find_stale(c, state_dir, flow_run_state)
    close_stale(c, stale)
    return stale
