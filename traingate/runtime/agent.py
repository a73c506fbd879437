"""torchrun's agent for a supervised one-node group: a preemption of the group restarts it in place.

``python -m traingate.runtime.agent [torchrun arguments]`` is ``python -m torch.distributed.run`` with
one difference, in how the agent takes a SIGTERM. torchrun's own handler shuts the group down and
exits, so a preempted group (a scheduler or an operator SIGTERMing the training tree while its
supervisor lives on) would come back only through a relaunch: a new agent, its imports, a backoff.
Here a SIGTERM nobody on our side asked for is passed on to the workers, which write the emergency
checkpoint and exit ``preempted`` (75, with last words saying so); torchrun then restarts the group in
place from that checkpoint, as after a lost worker, within ``--max-restarts``.

The agent shuts down as torchrun would (SIGTERM to the workers, grace, exit) when the SIGTERM is a
stop: the supervisor marked the launch stopped before signalling it (:func:`traingate.job.files.write_stop`:
a cancel, Ctrl-C, an alert, a hang, the stage's timeout), or the supervisor is gone (a rank that lost
its orchestrator SIGTERMs the agent, as does the CLI's guardian), or it is not this agent's to judge
(no supervisor named), or the group runs in a Slurm allocation, whose SIGTERM ends the job, or it spans
several nodes (the in-place restart is a one-node group's). A second SIGTERM while the workers are still
writing their checkpoint is one preemption, not two.

An agent that shut its group down on a SIGTERM leaves as soon as torchrun has stopped every worker,
without the interpreter's teardown of torch (2-3 s on a loaded node): a preempted Slurm job's GPUs go to
the job that preempted it that much sooner. Its exit code is torchrun's for that case, 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import FrameType

import psutil
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import api as elastic_api

from traingate.job import envvars, files
from traingate.runtime import compat_torch
from traingate.runtime.watchdog import StopFlag

_nodes: list[str] = []  # the group's --nnodes, as main() parsed it
_ONE_NODE = ("1", "1:1")


def stop_reason() -> str | None:
    """Why a SIGTERM to this agent must stop the group (None: a preemption, restart it in place)."""
    if _nodes and _nodes[0] not in _ONE_NODE:
        return f"the group spans {_nodes[0]} nodes"
    pid = envvars.supervisor_pid()
    stage_dir = envvars.stage_dir()
    if pid is None or stage_dir is None:
        return "no supervisor named"
    if (orphan := StopFlag.orphaned_now(pid)) is not None:
        return orphan
    if job := os.environ.get("SLURM_JOB_ID"):
        # Slurm's SIGTERM (preemption, scancel, the time limit) ends the allocation: a group restarted in
        # it would be killed at KillWait; the supervisor checkpoints and Slurm requeues the job instead.
        return f"Slurm job {job} is being stopped"
    if (stop := files.read_stop(stage_dir)) is not None:
        return f"the supervisor stops the launch: {stop}"
    return None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGTERM and stop_reason() is None:
        workers = psutil.Process().children()
        print(
            f"traingate agent: SIGTERM: the group is preempted; {len(workers)} worker(s) checkpoint and "
            "torchrun restarts the group in place",
            file=sys.stderr,
            flush=True,
        )
        for w in workers:  # a warm entry relays it to its worker
            with contextlib.suppress(psutil.Error):
                w.send_signal(signal.SIGTERM)
        return
    compat_torch.torch_terminate_handler(signum, frame)


def main(argv: list[str] | None = None) -> None:
    compat_torch.set_terminate_handler(_on_signal)
    _nodes[:] = [torchrun.parse_args(argv).nnodes]
    if _nodes[0] in _ONE_NODE:
        compat_torch.fast_one_node_rendezvous()  # every in-place restart is a rendezvous
    try:
        torchrun.main(argv)
    except elastic_api.SignalException as e:
        # torchrun has stopped every worker (each wrote what it owes and left); nothing of the agent is left to
        # write, so it skips the traceback and the interpreter's teardown of torch.
        print(f"traingate agent: {e}: the group is stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
