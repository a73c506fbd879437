"""How a StageJob is started: its command line. A pure function of the job."""

from __future__ import annotations

from pathlib import Path

from traingate.job.envvars import script_arg_values
from traingate.job.stagejob import StageJob
from traingate.launch.nodes import fan_out_command
from traingate.recipes.script import build_command, torchrun_args

# How often torchrun's agent polls its workers: a worker's exit (a preempted rank's, after its emergency checkpoint)
# waits half of it on average before the group restarts in place. torch's default is 0.1 s; 0.05 s costs the agent
# about 0.5% of a core (measured: 2 workers, +0.11 CPU-s per 10 s at 0.02 s).
MONITOR_INTERVAL_S = 0.05


def stage_command(job: StageJob, python: str, zygote_socket: str | None = None) -> list[str]:
    """The command of one launch of ``job``: a user's script, one process, or a torchrun group.

    A torchrun group may restart in place ``job.inplace_restarts`` times: faster than a relaunch
    (no new agent, no re-import of the launcher), counted against the supervisor's budget.
    A job on several nodes is the same agent on each of them (:mod:`traingate.launch.nodes`).
    """
    script = job.spec.recipe.script
    if job.nodes > 1 and (script is None or script.launcher == "torchrun"):
        return _on_every_node(job, python, _agent_command(job, python, zygote_socket))
    return _agent_command(job, python, zygote_socket)


def _on_every_node(job: StageJob, python: str, agent: list[str]) -> list[str]:
    endpoint = job.spec.resources.rdzv_endpoint
    assert endpoint, "validated by ResourcesSpec"
    # A rendezvous of its own per attempt: a relaunch never meets an agent of the attempt before it.
    return fan_out_command(python, job.nodes, f"{job.run_id}.{job.stage}.{job.attempt}", endpoint, agent)


def torchrun_log_dir(job: StageJob) -> str:
    """Where a torchrun group's agent keeps its per-rank files (a failed rank's ``error.json``): in the stage's
    directory, with the rest of what the stage leaves."""
    return str(Path(job.stage_dir) / "torchelastic")


def _agent_command(job: StageJob, python: str, zygote_socket: str | None) -> list[str]:
    if job.is_script:
        return build_command(
            job.spec,
            job.stage,
            python,
            job.procs_per_node,
            job.nodes,
            job.spec.resources.rdzv_endpoint,
            values=script_arg_values(job),
            resume=job.script_resume,
            log_dir=torchrun_log_dir(job),
        )
    tail = ["-m", "traingate.runtime.train", "--job", str(job.job_path)]
    if zygote_socket is not None:
        # Warm restarts (supervision.warm_restarts): a thin entry that has the zygote (the run's or the stage's)
        # fork the worker. The socket is an argument, not a TRAINGATE_* variable: reading envvars would import
        # traingate.secrets and pydantic (~0.3 s), ten times the entry's whole budget.
        tail = ["-m", "traingate.runtime.warm", zygote_socket, "--job", str(job.job_path)]
    if job.world_size == 1:
        return [python, *tail]
    # The agent is torchrun that leaves without torch's teardown once its group is stopped, and on one node
    # restarts the group in place after a preemption (traingate.runtime.agent); its supervisor, which tells a
    # preemption from a stop, runs beside it. It looks at its workers every MONITOR_INTERVAL_S.
    return [
        python,
        "-m",
        "traingate.runtime.agent",
        *torchrun_args(job.procs_per_node, job.nodes, job.spec.resources.rdzv_endpoint, torchrun_log_dir(job)),
        f"--max-restarts={job.inplace_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        *tail,
    ]
