"""Every environment variable the platform sets for a training process, writer beside reader.

A built-in recipe's process reads ONE of them, ``TRAINGATE_JOB`` (where its StageJob is); the
rest are for a user's own script (the ``script`` recipe: identity, locations, MLflow's run)
and for the instruments tests and drills use. Locations the *user* sets (``TRAINGATE_STATE_DIR``,
``TRAINGATE_S3_ENDPOINT_URL``, ...) are read in :mod:`traingate.settings` and inherited.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from traingate.secrets import resolve
from traingate.settings import CHECKPOINT_KEY_VAR, Settings, checkpoint_key

if TYPE_CHECKING:
    from traingate.job.stagejob import StageJob

JOB = "TRAINGATE_JOB"  # path of the attempt's job.json
SUPERVISOR_PID = "TRAINGATE_SUPERVISOR_PID"  # the process that must outlive the tree (see runtime.watchdog)
# For a user's script, which cannot read a StageJob (docs/scripts.md: "The script gets ...").
RUN_ID = "TRAINGATE_RUN_ID"
STAGE = "TRAINGATE_STAGE"
STAGE_DIR = "TRAINGATE_STAGE_DIR"
CHECKPOINT_DIR = "TRAINGATE_CHECKPOINT_DIR"
RESTART_CAUSE = "TRAINGATE_RESTART_CAUSE"
RESTART_COUNT = "TRAINGATE_RESTART_COUNT"
MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
MLFLOW_RUN_ID = "MLFLOW_RUN_ID"
UNIT_SPEC = "TRAINGATE_SPEC"  # the unit stage's pytest reads the resolved spec from here
# Instruments for tests, drills and benchmarks; never set in production.
INJECT = "TRAINGATE_INJECT"  # fault plan, see traingate.runtime.inject
FAULT = "TRAINGATE_FAULT"  # "<phase>@<step>": SIGKILL at that phase of a checkpoint save
RECORD_SAMPLES = "TRAINGATE_RECORD_SAMPLES"  # "1": each rank logs the sample ids of every step
TRACKING_DRAIN_S = "TRAINGATE_TRACKING_DRAIN_S"  # how long a closing tracker keeps delivering to a dead store
TRACKING_RETRY_S = "TRAINGATE_TRACKING_RETRY_S"  # the orchestrator's waits between tries of a write to a dead store
# The names a script's command, stage_args and resume_args may reference as ${NAME}, expanded at launch
# (traingate.recipes.script.expand). Locations and ids only: nothing secret ever reaches argv this way.
SCRIPT_ARG_VARS = (RUN_ID, STAGE, STAGE_DIR, CHECKPOINT_DIR, RESTART_CAUSE, RESTART_COUNT, JOB)
# torchrun's own: how many times it restarted the worker group in place.
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
# torchrun sets OMP_NUM_THREADS=1 per worker when it is unset; a plain single process gets the same, so
# the smoke stage, scripts and bare benchmarks measure the same thing. A value the user set is kept.
OMP_THREADS = "OMP_NUM_THREADS"
OMP_THREADS_DEFAULT = "1"


def job_environment(
    job: StageJob, base: Mapping[str, str] | None = None, supervisor_pid: int | None = None
) -> dict[str, str]:
    """The environment a stage's processes get (writer)."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            JOB: str(job.job_path),
            RUN_ID: job.run_id,
            STAGE: job.stage,
            STAGE_DIR: job.stage_dir,
            CHECKPOINT_DIR: _checkpoint_dir(job),
            SUPERVISOR_PID: str(supervisor_pid or os.getpid()),
            "PYTHONUNBUFFERED": "1",
        }
    )
    for var in (RESTART_CAUSE, RESTART_COUNT, MLFLOW_RUN_ID):
        env.pop(var, None)
    if job.restart_cause:
        env.update({RESTART_CAUSE: str(job.restart_cause), RESTART_COUNT: str(job.attempt)})
    if job.tracking_uri:
        # A script's MLflow reads the real URI: the environment is handed over, never written to a file.
        env[MLFLOW_TRACKING_URI] = resolve(job.tracking_uri, env=env, field="tracking URI")
        if job.mlflow_run_id:
            env[MLFLOW_RUN_ID] = job.mlflow_run_id
    if job.faults:
        env[INJECT] = job.faults
    # This deployment's checkpoint key (this process's settings), in the environment: a training process
    # may start in a directory where the state dir's relative default would name another key.
    env.setdefault(CHECKPOINT_KEY_VAR, checkpoint_key(Settings.from_env()).decode())
    if OMP_THREADS not in env:  # only when unset: a value the user chose is theirs (see omp_threads_note)
        env[OMP_THREADS] = OMP_THREADS_DEFAULT
    return env


def omp_threads_note(env: Mapping[str, str] | None = None) -> str | None:
    """The line that says traingate sets OMP_NUM_THREADS for a stage's processes, or None when the
    environment the stages inherit (``env``, default this process's) sets it already.

    >>> omp_threads_note({"OMP_NUM_THREADS": "8"}) is None
    True
    >>> omp_threads_note({}).startswith("OMP_NUM_THREADS=1 for the stage processes")
    True
    """
    if OMP_THREADS in (os.environ if env is None else env):
        return None
    return (
        f"{OMP_THREADS}={OMP_THREADS_DEFAULT} for the stage processes (unset here): one OpenMP thread each, as "
        f"torchrun gives every worker, so processes sharing the CPUs do not oversubscribe them; set "
        f"{OMP_THREADS} to choose"
    )


def _checkpoint_dir(job: StageJob) -> str:
    # A script writes plain files into a local directory (it cannot write s3://); a built-in recipe
    # reads its StageJob and sees the checkpoint URI itself.
    return job.checkpoint_dir if job.is_script else job.checkpoint_uri


def script_arg_values(job: StageJob) -> dict[str, str]:
    """What each of :data:`SCRIPT_ARG_VARS` stands for in one launch of a script (the values its
    environment holds; the restart variables are "" and "0" on a first launch)."""
    return {
        RUN_ID: job.run_id,
        STAGE: job.stage,
        STAGE_DIR: job.stage_dir,
        CHECKPOINT_DIR: _checkpoint_dir(job),
        RESTART_CAUSE: str(job.restart_cause or ""),
        RESTART_COUNT: str(job.attempt),
        JOB: str(job.job_path),
    }


def job_path(env: Mapping[str, str] | None = None) -> Path | None:
    """Where this process's StageJob is (reader)."""
    value = (os.environ if env is None else env).get(JOB)
    return Path(value) if value else None


def supervisor_pid(env: Mapping[str, str] | None = None) -> int | None:
    value = (os.environ if env is None else env).get(SUPERVISOR_PID, "")
    return int(value) if value.isdigit() else None


def stage_dir(env: Mapping[str, str] | None = None) -> Path | None:
    value = (os.environ if env is None else env).get(STAGE_DIR, "")
    return Path(value) if value else None


def inplace_restart_count(env: Mapping[str, str] | None = None) -> int:
    return int((os.environ if env is None else env).get(TORCHELASTIC_RESTART_COUNT, "0") or 0)


@dataclass(frozen=True)
class Instruments:
    """Test and drill knobs a training process honours (reader of the instrument variables)."""

    fault: str | None = None
    record_samples: bool = False
    inject: str = ""  # a fault plan: the job's (drills) arrives here too, through the environment

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> Instruments:
        env = os.environ if env is None else env
        return cls(
            fault=env.get(FAULT) or None, record_samples=env.get(RECORD_SAMPLES, "") == "1", inject=env.get(INJECT, "")
        )

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


def tracking_drain_s(env: Mapping[str, str] | None = None, default: float = 120.0) -> float:
    return float((os.environ if env is None else env).get(TRACKING_DRAIN_S, default))


def tracking_retry_s(env: Mapping[str, str] | None = None, default: tuple[float, ...] = (1, 5, 15)) -> list[float]:
    """The waits before each retry of an orchestrator write while the tracking store is unreachable.

    >>> tracking_retry_s({TRACKING_RETRY_S: "0.2,0.5"}), tracking_retry_s({})
    ([0.2, 0.5], [1, 5, 15])
    """
    raw = (os.environ if env is None else env).get(TRACKING_RETRY_S)
    if raw is None:
        return list(default)
    try:
        waits = [float(w) for w in raw.split(",")]
    except ValueError:
        waits = [-1.0]
    if not all(0 <= w < float("inf") for w in waits):
        raise ValueError(f"{TRACKING_RETRY_S} = {raw!r}: give the waits in seconds, comma-separated, e.g. 1,5,15")
    return waits
