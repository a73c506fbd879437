"""The Slurm CLI, run: each function is one command (sbatch, squeue, sacct, scontrol, scancel, srun).

The controller is the one ``SLURM_CONF`` in the environment names. A controller that does not answer
(restarting, a network blip) raises :class:`Unreachable`, which callers that follow a job retry; any
other failure raises :class:`SlurmError` with what the command printed. Parsing is
:mod:`traingate.capacity.slurm`.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import subprocess
from collections.abc import Mapping, Sequence

from traingate.capacity import slurm
from traingate.capacity.pools import CapacityConfig, Engine
from traingate.capacity.slurm import SlurmError, Unreachable, unreachable
from traingate.settings import NODES_VAR

TIMEOUT_S = 30.0


def run(args: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = TIMEOUT_S) -> str:
    """Run one Slurm command; its stdout, or :class:`Unreachable` / :class:`SlurmError` with its words."""
    try:
        out = subprocess.run(
            list(args), capture_output=True, text=True, timeout=timeout_s, env=dict(env) if env is not None else None
        )
    except FileNotFoundError:
        raise SlurmError(
            f"{args[0]}: not found; install the Slurm client (slurm-client) on this host and put it on PATH"
        ) from None
    except subprocess.TimeoutExpired:
        raise Unreachable(f"{' '.join(args[:2])}: no answer in {timeout_s:.0f} s") from None
    if out.returncode != 0:
        said = " ".join((out.stderr or out.stdout).split()) or f"exit code {out.returncode}"
        if unreachable(said):
            raise Unreachable(f"{args[0]}: {said}")
        raise SlurmError(f"{' '.join(args[:2])}: {said}")
    return out.stdout


def submit(cmd: Sequence[str], job, pool) -> str:
    """sbatch; the job id. A refusal is one line naming the job's value Slurm refused and the fix."""
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmError("sbatch: not found; install the Slurm client (slurm-client) on the worker's host") from None
    except subprocess.TimeoutExpired:
        raise Unreachable(f"sbatch: no answer in {TIMEOUT_S:.0f} s") from None
    if out.returncode != 0:
        said = " ".join(out.stderr.split())
        if unreachable(said):
            raise Unreachable(f"sbatch: {said}")
        raise SlurmError(slurm.refusal(out.stderr, job, pool))
    return slurm.parse_job_id(out.stdout)


def check_entitled(team: str, priority: str, user: str | None = None) -> None:
    """SlurmError (one line: account or QOS and the fix) unless ``user`` (default: this process's) may submit for
    account ``team`` with QOS ``priority``, as Slurm's associations say. Reads; submits nothing."""
    name = user or pwd.getpwuid(os.geteuid()).pw_name
    text = run(["sacctmgr", "--noheader", "--parsable2", "show", "assoc", f"user={name}", "format=account,qos"])
    problem = slurm.entitlement_problem(slurm.associations(text), name, team, priority)
    if problem is not None:
        raise SlurmError(problem)


def check_pool_entitled(config: CapacityConfig | None, work_pool: str, team: str, priority: str) -> None:
    """On a Slurm pool of ``config``: :func:`check_entitled`; on any other pool (or without a config), nothing.
    The ladder calls it before it creates anything (MLflow run, stage directory, Slurm job); sbatch's own
    refusal stays the backstop."""
    pool = config.pools.get(work_pool) if config is not None else None
    if pool is not None and pool.engine == Engine.SLURM:
        check_entitled(team, priority)


def show_config() -> str:
    return run(["scontrol", "show", "config"])


def squeue() -> str:
    return run(["squeue", "--json"])


def sinfo() -> str:
    return run(["sinfo", "--json"])


def sacct(job_id: str) -> str:
    return run(["sacct", "-j", str(job_id), "--json"])


def cancel(job_id: str, batch_signal: str | None = None) -> None:
    """scancel; with ``batch_signal`` only that signal to the batch step (the job goes on until it exits)."""
    run(["scancel", *([f"--signal={batch_signal}", "--batch"] if batch_signal else []), str(job_id)])


def show_job(job_id: str) -> str:
    """``scontrol show job -o ID``: read with :func:`slurm.preempted` and :func:`slurm.requeued`."""
    return run(["scontrol", "show", "job", "-o", str(job_id)])


def requeue(job_id: str) -> None:
    run(["scontrol", "requeue", str(job_id)])


def hostnames(nodelist: str) -> list[str]:
    """``n[1-2]`` -> ["n1", "n2"]; one node's list is its name, with no scontrol process on the way.

    >>> hostnames("n1")
    ['n1']
    """
    if nodelist and not any(c in nodelist for c in "[,"):
        return [nodelist]
    return run(["scontrol", "show", "hostnames", nodelist]).split()


def node_addresses() -> dict[str, str]:
    return slurm.node_addresses(run(["scontrol", "show", "node", "-o"]))


def partition_max_time(partition: str) -> int | None:
    return slurm.partition_max_time(run(["scontrol", "show", "partition", partition, "-o"]))


def set_node_state(node: str, state: str, reason: str | None = None) -> None:
    """``scontrol update nodename=N state=drain reason=...`` (or state=resume)."""
    run(["scontrol", "update", f"nodename={node}", f"state={state}", *([f"reason={reason}"] if reason else [])])


def step_prefix(node: str) -> tuple[str, ...]:
    """How to run one command on ``node`` of this allocation: a one-task step beside the batch step.

    ``--overlap``: the step shares the allocation's CPUs and GPUs with the batch step (which holds
    them); ``--kill-on-bad-exit``: the step ends with its agent; ``--export=ALL``: the agent gets the
    stage's environment (launch_nodes adds the per-node part).
    """
    return (
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--overlap",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--quiet",
    )


def interface_of(node: str, addr: str) -> str | None:
    """The network interface that holds ``addr`` on ``node`` (gloo binds to it), asked on the node itself."""
    out = run([*step_prefix(node), "ip", "-o", "-4", "addr", "show"], env=os.environ)
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields and fields[fields.index("inet") + 1].split("/")[0] == addr:
            return fields[1].rstrip(":")
    return None


def node_of_rank(rank: int | None, procs_per_node: int, env: Mapping[str, str]) -> str | None:
    """The Slurm node a rank of this allocation runs on (None outside a Slurm job).

    Several nodes: c10d numbers the nodes in the order of their addresses (traingate.launch.nodes), node i
    holding ranks i*procs_per_node ...; one node: the batch step's own.
    """
    if not env.get("SLURM_JOB_ID"):
        return None
    listed = env.get(NODES_VAR, "")
    if listed.startswith("slurm:") and rank is not None:
        names = listed.removeprefix("slurm:").split(",")
        addrs = node_addresses()
        ordered = sorted(names, key=lambda n: ipaddress.ip_address(addrs.get(n, "0.0.0.0")))
        return ordered[min(rank // max(1, procs_per_node), len(ordered) - 1)]
    return env.get("SLURMD_NODENAME") or None
