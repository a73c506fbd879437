"""StageJob: every fact of one attempt of one stage, derived ONCE from a validated RunSpec.

It is what the scheduler admits (pool, slots, team, priority), what the ledger charges
(slots x price), what the supervisor launches (processes, limits, directories, checkpoint,
tracking ids) and the one thing a training process reads (``job.json`` next to the stage).
A restart is the same job with the next attempt number and its cause
(:meth:`StageJob.next_attempt`); nothing re-derives any of it from ``(spec, stage)``.

>>> from traingate.spec import load_spec_text
>>> from traingate.settings import Settings
>>> spec = load_spec_text("identity: {experiment: e, owner: o, team: vision, purpose: p}\\n"
...                       "recipe: {name: digits-cnn}\\nresources: {procs_per_node: 2}")
>>> job = derive(spec, "canary", run_id="r1", run_dir="/tmp/tg/runs/r1",
...              settings=Settings.from_env({"TRAINGATE_STATE_DIR": "/tmp/tg"}))
>>> job.world_size, job.slots, job.pool, job.team, job.priority
(2, 2, 'cpu-local', 'vision', 'research')
>>> job.checkpoint_uri
'file:///tmp/tg/checkpoints/r1/canary'
>>> job.next_attempt("worker_lost", 12.5).attempt
1
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from traingate.alerts.rules import checkpoint_interval_s
from traingate.job import files, sizing
from traingate.job.vocab import Cause
from traingate.job.world import stage_world
from traingate.redact import redact
from traingate.settings import TRACKING_URI_VAR, Settings
from traingate.spec import RunSpec, ScriptRecipe, parse_spec
from traingate.storage import join


class JobKind(StrEnum):
    LADDER = "ladder"  # a stage of the ladder (also when it is resumed)
    TRIAL = "trial"  # a sweep trial's stage
    DRILL = "drill"  # a fault-injection drill's run


@dataclass(frozen=True)
class Rollback:
    """A roll-back the supervisor ordered: resume at ``to_step`` (the last checkpoint before the event at
    ``at_step``), draw and discard the next ``skip`` batches, and train on at ``lr_scale`` x the schedule."""

    to_step: int
    at_step: int
    skip: int
    lr_scale: float
    rule: str


@dataclass(frozen=True)
class StageJob:
    spec: RunSpec
    run_id: str
    stage: str
    kind: JobKind
    # where and how wide
    nodes: int
    procs_per_node: int
    pool: str
    slots: int
    price_per_slot_hour: float
    # who, for the scheduler
    team: str
    priority: str
    # limits
    max_steps: int
    timeout_s: float
    # checkpoint interval: every N steps and/or every S seconds (None: that trigger is off). The training
    # loop saves by them, the supervisor judges staleness by them and the scheduler prices a preemption by them.
    checkpoint_every_steps: int | None
    checkpoint_every_s: float | None
    # locations
    run_dir: str
    stage_dir: str
    checkpoint_uri: str
    tracking_uri: str | None  # None: this job is not tracked
    mlflow_run_id: str | None
    # this attempt
    attempt: int = 0
    restart_cause: Cause | None = None
    restart_fault_ts: float | None = None
    launched_at: float | None = None
    inplace_restarts: int = 0  # how many times torchrun may restart the group in place (supervisor's budget)
    # what this launch does beyond training to max_steps
    stop_at_step: int | None = None
    eval_every: int = 0
    faults: str | None = None  # a fault plan (drills and tests; traingate.runtime.inject)
    rollbacks: tuple[Rollback, ...] = ()  # this stage's roll-backs so far, oldest first
    # who delivers rank 0's tracking journal to MLflow: the training process itself, or its supervisor
    tracking_delivery: str = "process"
    # money: the budget that applies (None: none) and what its scope had spent before this stage began
    budget_usd: float | None = None
    budget_scope: str = "run"
    spent_before_usd: float = 0.0
    # a script's launch that appends recipe.script.resume_args: a restart, and the script left a checkpoint
    script_resume: bool = False

    # ---------------------------------------------------------------- derived facts
    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def job_path(self) -> Path:
        return Path(self.stage_dir) / files.JOB

    @property
    def is_script(self) -> bool:
        return self.spec.recipe.name == "script"

    @property
    def script(self) -> ScriptRecipe:
        """A script job's recipe.script (the spec has one whenever recipe.name is script)."""
        assert self.spec.recipe.script is not None, f"{self.stage}: not a script job"
        return self.spec.recipe.script

    @property
    def checkpoint_dir(self) -> str:
        """The local directory a script writes its checkpoints into (``${TRAINGATE_CHECKPOINT_DIR}``): the
        checkpoint URI's own path when it is local, else ``<stage dir>/checkpoints``, which traingate
        uploads to the URI (a script writes files; it cannot write to s3://)."""
        uri = self.checkpoint_uri
        if uri.startswith("file://"):
            return urlsplit(uri).path
        if "://" not in uri:
            return uri
        return str(Path(self.stage_dir) / "checkpoints")

    @property
    def writes_heartbeats(self) -> bool:
        """Built-in recipes write heartbeats and result.json; a user's script writes neither."""
        return not self.is_script

    def checkpoint_interval_s(self, step_time_s: float | None) -> float | None:
        """The expected seconds between checkpoints at ``step_time_s`` per step: the sooner trigger."""
        return checkpoint_interval_s(self.checkpoint_every_steps, self.checkpoint_every_s, step_time_s)

    def lr_scale_at(self, step: int) -> float:
        """The learning-rate factor of the roll-backs that went back to ``step`` or before."""
        scale = 1.0
        for r in self.rollbacks:
            if r.to_step <= step:
                scale *= r.lr_scale
        return scale

    def batches_to_skip(self, resumed_at: int) -> int:
        """Batches to draw and discard after resuming at ``resumed_at`` (the roll-backs that went back there)."""
        return sum(r.skip for r in self.rollbacks if r.to_step == resumed_at)

    # ---------------------------------------------------------------- attempts
    def next_attempt(self, cause: Cause | str, fault_ts: float | None, spec: RunSpec | None = None) -> StageJob:
        """The relaunch after a failure: same job, next attempt, the cause recorded (and a changed
        spec when a restart policy changed it, e.g. OOM halving the micro-batch)."""
        return dataclasses.replace(
            self,
            attempt=self.attempt + 1,
            restart_cause=Cause(cause),
            restart_fault_ts=fault_ts,
            spec=spec or self.spec,
            launched_at=None,
        )

    def launch(self, now: float, inplace_restarts: int = 0, **changes: Any) -> StageJob:
        return dataclasses.replace(self, launched_at=now, inplace_restarts=inplace_restarts, **changes)

    # ---------------------------------------------------------------- the file
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["spec"] = self.spec.to_dict()
        d["rollbacks"] = [dataclasses.asdict(r) for r in self.rollbacks]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageJob:
        d = dict(d)
        d["spec"] = parse_spec(d["spec"])
        d["kind"] = JobKind(d["kind"])
        if d.get("restart_cause"):
            d["restart_cause"] = Cause(d["restart_cause"])
        d["rollbacks"] = tuple(Rollback(**r) for r in d.get("rollbacks") or ())
        return cls(**d)

    def write(self) -> Path:
        """Write ``job.json`` into the stage directory (atomically) and return its path."""
        Path(self.stage_dir).mkdir(parents=True, exist_ok=True)
        files.write_json(self.job_path, self.to_dict())
        return self.job_path

    @classmethod
    def read(cls, path: str | Path) -> StageJob:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _without_secrets(tracking_uri: str) -> str:
    """The tracking URI as the job file may hold it: a URI with a password (``postgresql://u:pw@db``)
    is written as a reference to the variable it came from, resolved by the process that uses it."""

    if redact(tracking_uri) != tracking_uri and os.environ.get(TRACKING_URI_VAR) == tracking_uri:
        return "${env:" + TRACKING_URI_VAR + "}"
    return tracking_uri


def stage_timeout_s(spec: RunSpec, stage: str) -> float:
    """The longest an attempt of ``stage`` may run: the stage's limit, or a script's own timeout when lower."""
    timeout_s = getattr(spec.stages, stage).timeout_s
    if spec.recipe.script is not None:
        timeout_s = min(timeout_s, spec.recipe.script.timeout_s)
    return timeout_s


def derive(
    spec: RunSpec,
    stage: str,
    *,
    run_id: str,
    run_dir: str | Path,
    settings: Settings,
    mlflow_run_id: str | None = None,
    kind: JobKind = JobKind.LADDER,
    stage_dir: str | Path | None = None,
    checkpoint_uri: str | None = None,
    eval_every: int = 0,
    stop_at_step: int | None = None,
    faults: str | None = None,
) -> StageJob:
    """The StageJob of ``stage`` of a validated ``spec``: the one place these facts are computed."""

    nodes, nproc = stage_world(spec, stage)
    limits = getattr(spec.stages, stage)
    stage_dir = Path(stage_dir) if stage_dir is not None else Path(run_dir) / stage
    tracked = spec.tracking.enabled
    return StageJob(
        spec=spec,
        run_id=run_id,
        stage=stage,
        kind=kind,
        nodes=nodes,
        procs_per_node=nproc,
        pool=spec.resources.work_pool,
        slots=sizing.slots(nodes * nproc),
        price_per_slot_hour=spec.pool.price_per_gpu_hour,
        team=spec.identity.team,
        priority=spec.resources.priority,
        max_steps=limits.max_steps,
        timeout_s=stage_timeout_s(spec, stage),
        checkpoint_every_steps=spec.checkpoint.every_steps,
        checkpoint_every_s=spec.checkpoint.every_minutes * 60.0 if spec.checkpoint.every_minutes else None,
        run_dir=str(run_dir),
        stage_dir=str(stage_dir),
        checkpoint_uri=checkpoint_uri or join(spec.checkpoint.uri or settings.checkpoint_uri, run_id, stage),
        tracking_uri=_without_secrets(settings.tracking_uri) if tracked else None,
        mlflow_run_id=mlflow_run_id if tracked else None,
        eval_every=eval_every,
        stop_at_step=stop_at_step,
        faults=faults,
    )
