"""What differs, for the supervisor, between a built-in recipe and a user's script: one interface,
:class:`RecipeDriver`, with one implementation each, chosen once per job by :func:`driver_for`.

A built-in recipe's ranks write heartbeats, last words and result.json, journal their tracking for the
supervisor to deliver, save through the Checkpointer and may restart in place under torchrun. A user's
script writes none of that: its output is its progress, it keeps its own checkpoint files (declared by
``recipe.script.checkpoints``, published after every launch) and resumes when its ``resume_args`` are
appended. The supervisor's loop asks the driver and never asks which kind of job it has.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import weakref
from abc import ABC, abstractmethod
from pathlib import Path

from traingate.job import envvars
from traingate.job.stagejob import StageJob
from traingate.monitor.live import StageMonitor
from traingate.recipes import script as script_recipe
from traingate.runtime import warm
from traingate.secrets import resolve
from traingate.storage import storage_failure
from traingate.supervision.attempts import Attempt, Hooks, Record
from traingate.supervision.backoff import RetryBudget
from traingate.supervision.checkpoints import latest_checkpoint
from traingate.supervision.watch import OutputWatch, Watch
from traingate.tracking.journal import journal_path
from traingate.tracking.tracker import Delivery


class RecipeDriver(ABC):
    """How the supervisor launches, watches, resumes and judges one kind of training process."""

    @abstractmethod
    def cold_start_reason(self, job: StageJob) -> str | None:
        """Why ``supervision.warm_restarts`` cannot serve ``job`` (None: a zygote forks its workers)."""

    @abstractmethod
    def delivery(self, job: StageJob) -> Delivery | None:
        """The delivery of rank 0's tracking journal, run by the supervisor (None: nothing to deliver)."""

    @abstractmethod
    def monitor(self, job: StageJob, started: float) -> StageMonitor | None:
        """The alert rules' monitor of the stage (None: no signals for them to read)."""

    @abstractmethod
    def launch(self, job: StageJob, now: float, restarts_left: int, hooks: Hooks) -> StageJob:
        """The job of the next launch, with how it restarts in place and whether it resumes."""

    @abstractmethod
    def resume_point(self, job: StageJob) -> tuple[int | None, bool]:
        """The checkpoint step this launch starts from (None: none) and whether that step is unknown.
        Recorded with the attempt before it launches."""

    @abstractmethod
    def restart_point(self, job: StageJob) -> tuple[int | None, bool]:
        """The checkpoint step a restart after this launch would resume from, and whether it is unknown."""

    @abstractmethod
    def workdir(self, job: StageJob) -> str:
        """The directory the launch runs in."""

    @abstractmethod
    def watch(
        self,
        job: StageJob,
        hang_s: float,
        attempts: list[Attempt],
        budget: RetryBudget,
        hooks: Hooks,
        record: Record,
        monitor: StageMonitor | None,
        started: float,
    ) -> Watch:
        """What follows the launch every tick (hang, progress, alerts)."""

    @abstractmethod
    def ranks(self, job: StageJob) -> int | None:
        """The ranks whose heartbeats and result.json say how a launch ended (None: it writes neither)."""

    @abstractmethod
    def publish(self, job: StageJob, hooks: Hooks) -> str | None:
        """After every launch: make its checkpoints reachable for a restart elsewhere; why that failed, or None."""


class BuiltinDriver(RecipeDriver):
    """A built-in recipe: the runtime's ranks report by heartbeats and save through the Checkpointer."""

    def cold_start_reason(self, job: StageJob) -> str | None:
        return None if job.nodes == 1 else f"{job.nodes} nodes (a zygote serves the workers of its own host)"

    def delivery(self, job: StageJob) -> Delivery | None:
        if not (job.spec.tracking.enabled and job.tracking_uri and job.mlflow_run_id):
            return None
        path = journal_path(Path(job.stage_dir))
        path.parent.mkdir(parents=True, exist_ok=True)
        return Delivery(resolve(job.tracking_uri, field="tracking URI"), job.mlflow_run_id, path, until_records=True)

    def monitor(self, job: StageJob, started: float) -> StageMonitor | None:
        if not job.spec.alerts.enabled:
            return None
        return StageMonitor(
            job.spec.alerts,
            Path(job.stage_dir),
            job.slots,
            job.price_per_slot_hour,
            job.budget_usd,
            job.spent_before_usd,
            job.budget_scope,
            started,
        )

    def launch(self, job: StageJob, now: float, restarts_left: int, hooks: Hooks) -> StageJob:
        # Several nodes: no in-place restarts. Each node's agent counts its own restarts (the ranks'
        # restart_count would disagree across nodes) and a lost node takes its agent with it.
        inplace = job.world_size > 1 and job.nodes == 1
        return job.launch(now, inplace_restarts=restarts_left if inplace else 0)

    def resume_point(self, job: StageJob) -> tuple[int | None, bool]:
        return latest_checkpoint(job.checkpoint_uri)[0], False

    def restart_point(self, job: StageJob) -> tuple[int | None, bool]:
        return latest_checkpoint(job.checkpoint_uri)[0], False

    def workdir(self, job: StageJob) -> str:
        return job.stage_dir

    def watch(
        self,
        job: StageJob,
        hang_s: float,
        attempts: list[Attempt],
        budget: RetryBudget,
        hooks: Hooks,
        record: Record,
        monitor: StageMonitor | None,
        started: float,
    ) -> Watch:
        return Watch(job, hang_s, attempts, budget, hooks, record, self.restart_point, monitor, started)

    def ranks(self, job: StageJob) -> int | None:
        return job.world_size

    def publish(self, job: StageJob, hooks: Hooks) -> str | None:
        return None  # the Checkpointer uploads each checkpoint as it saves it


class ScriptDriver(RecipeDriver):
    """A user's script: its output is its progress; its checkpoints are its own files."""

    def cold_start_reason(self, job: StageJob) -> str | None:
        return "a script recipe (its command is the user's)"

    def delivery(self, job: StageJob) -> Delivery | None:
        return None  # it writes no tracking journal

    def monitor(self, job: StageJob, started: float) -> StageMonitor | None:
        return None  # it writes no heartbeats for the rules to read

    def launch(self, job: StageJob, now: float, restarts_left: int, hooks: Hooks) -> StageJob:
        return job.launch(now, inplace_restarts=0, script_resume=self._resumes(job, hooks))

    def resume_point(self, job: StageJob) -> tuple[int | None, bool]:
        # By its file name, and only when its resume_args are appended.
        step = script_recipe.latest_step(job.checkpoint_dir, job.script.checkpoints) if job.script_resume else None
        return step, job.script_resume and step is None

    def restart_point(self, job: StageJob) -> tuple[int | None, bool]:
        s = job.script
        step = script_recipe.latest_step(job.checkpoint_dir, s.checkpoints) if s.resume_args else None
        # It resumes from a checkpoint whose name holds no step: from where is unknown, and so are the steps lost.
        unknown = (
            bool(s.resume_args) and step is None and script_recipe.has_checkpoint(job.checkpoint_dir, s.checkpoints)
        )
        return step, unknown

    def workdir(self, job: StageJob) -> str:
        return job.script.workdir

    def watch(
        self,
        job: StageJob,
        hang_s: float,
        attempts: list[Attempt],
        budget: RetryBudget,
        hooks: Hooks,
        record: Record,
        monitor: StageMonitor | None,
        started: float,
    ) -> Watch:
        progress = script_recipe.OutputProgress(job.script.metrics, Path(job.stage_dir), job.attempt)
        return OutputWatch(job, hang_s, attempts, budget, hooks, record, self.restart_point, progress)

    def ranks(self, job: StageJob) -> int | None:
        return None

    def publish(self, job: StageJob, hooks: Hooks) -> str | None:
        """Index (and upload, to a remote URI) what the script declared it writes, so a restart on another
        host finds them. Returns why it failed, for a storage error, else None."""
        s = job.script
        if s.checkpoints is None:
            return None
        try:
            entries = script_recipe.publish(job.checkpoint_dir, s.checkpoints, job.checkpoint_uri)
        except Exception as e:  # noqa: BLE001 - storage errors are reported; anything else is a bug and raised
            why = storage_failure(e)
            if why is None:
                raise
            msg = f"its checkpoints were not published to {job.checkpoint_uri}: {why}"
            hooks.info(f"{job.stage}: {msg}")
            return msg
        last = script_recipe.newest(entries)
        hooks.info(
            f"{job.stage}: {len(entries)} checkpoint file(s) indexed at {job.checkpoint_uri}"
            + (f", newest {last.path}" if last is not None else "")
        )
        return None

    def _resumes(self, job: StageJob, hooks: Hooks) -> bool:
        """Whether this launch appends the script's resume_args, decided from what is on disk and never
        from the attempt records (a supervisor killed mid-launch leaves its attempt unfinished): the script's
        declared checkpoint is there. Its checkpoint dir is made first; on a host without the local copy the
        set published at a remote checkpoint URI is brought back first."""
        s = job.script
        Path(job.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        if not s.resume_args:
            if script_recipe.has_checkpoint(job.checkpoint_dir, s.checkpoints):
                hooks.info(
                    f"{job.stage}: the script's checkpoints are in {job.checkpoint_dir} but recipe.script.resume_args "
                    "is empty: it starts over and may overwrite them; declare the flags that make it resume"
                )
            return False
        if restored := script_recipe.restore(job.checkpoint_uri, job.checkpoint_dir, s.checkpoints):
            hooks.info(f"{job.stage}: {len(restored)} checkpoint file(s) brought back from {job.checkpoint_uri}")
        if script_recipe.has_checkpoint(job.checkpoint_dir, s.checkpoints):
            return True
        if job.attempt > 0:
            hooks.info(
                f"{job.stage}: restart {job.attempt}: the script left no checkpoint yet "
                f"({s.checkpoints or 'an empty checkpoint dir'}); it starts over, without its resume_args"
            )
        return False


def driver_for(job: StageJob) -> RecipeDriver:
    """The driver of ``job``'s kind: the one place the supervisor asks whether it runs a script."""
    return ScriptDriver() if job.is_script else BuiltinDriver()


ZYGOTE_LOG = "zygote.log"  # in the stage directory


def starts_warm(job: StageJob) -> bool:
    """Whether a zygote forks ``job``'s workers: ``supervision.warm_restarts``, on a job a zygote can serve."""
    return job.spec.warm_restarts and driver_for(job).cold_start_reason(job) is None


def start_zygote(job: StageJob, python: str = sys.executable, shared: bool = False) -> warm.Zygote | None:
    """``job``'s zygote (supervision.warm_restarts), None when its workers start cold. It imports the training
    stack and forks nothing until a worker of the stage asks: the ladder starts its run's beside the unit
    stage, whose gate still decides whether any worker starts. ``shared``: the run's, which every stage of
    the run that starts warm on this host borrows (its log is the run directory's ``zygote.log``); the one
    who started it stops it. Otherwise the stage's supervision takes it over and stops it with the stage."""
    if not starts_warm(job):
        return None
    log_dir = Path(job.run_dir if shared else job.stage_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    zygote = warm.Zygote(python, envvars.job_environment(job), str(log_dir / ZYGOTE_LOG), shared=shared)
    weakref.finalize(zygote, _stop_unused, zygote.popen, zygote.dir)  # one no supervision took over
    return zygote


def adopt_zygote(job: StageJob, handle: str) -> warm.Zygote | None:
    """The zygote ``python -m traingate.runtime.warm --ahead`` started before it exec'd into this process
    (``handle``: its ``--zygote``), taken over for ``job``; stopped and None when ``job`` starts cold."""
    zygote = warm.Zygote.adopt(handle, str(Path(job.stage_dir) / ZYGOTE_LOG))
    weakref.finalize(zygote, _stop_unused, zygote.popen, zygote.dir)
    if not starts_warm(job):
        zygote.stop()
        return None
    return zygote


def _stop_unused(popen: subprocess.Popen, directory: str) -> None:
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
    shutil.rmtree(directory, ignore_errors=True)
