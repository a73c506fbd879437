"""The batch step of a Slurm job: ``python -m traingate.ladder.slurm_batch --job PATH``.

It runs inside the allocation, on its first node, and trains the stage exactly as the local engine
does (:func:`traingate.ladder.stage_run.train`: the same supervisor, heartbeats, restarts,
emergency checkpoint). A job on several nodes starts one torchrun agent per allocated node through
:mod:`traingate.launch.nodes` (``TRAINGATE_NODES=slurm:n1,n2``: a one-task ``srun --overlap`` step
each), its c10d rendezvous on the first node's NodeAddr, gloo bound to each node's interface.

Preemption: the job is submitted with ``--requeue --signal=B:TERM@<grace>``; the SIGTERM reaches this
process (the batch shell exec'd into it), the supervisor stops the tree at its emergency checkpoint,
and this step asks Slurm to requeue the job before it exits (a job that ends by itself inside its
grace time would end COMPLETED and never come back). The next allocation resumes from the
checkpoint, in the same traingate run and the same MLflow run. A SIGTERM after traingate wrote
``slurm_stop`` in the stage directory (a flow run cancelled) is a stop: no requeue.

A warm stage (``supervision.warm_restarts`` on one node) is submitted as ``python -m traingate.runtime.warm
--ahead LOG`` exec'ing into this step with ``--zygote PID:DIR``: its zygote's imports (torch, TorchDynamo, the
trainer) run beside this step's own, and its supervision takes that zygote over.

Its verdict is the supervisor's, in the stage directory (supervisor.json), for the submitter to read.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
import time
from pathlib import Path

import psutil

from traingate.capacity import slurm, slurm_cli
from traingate.capacity.slurm import SIGNALLED, STOP_FILE, SlurmError
from traingate.job import files
from traingate.job.stagejob import StageJob
from traingate.job.vocab import Status
from traingate.ladder import stage_run
from traingate.settings import NODES_VAR
from traingate.supervision.drivers import adopt_zygote
from traingate.supervision.supervisor import Hooks, Supervision, read_state, request_stop, stop_request

_signalled: list[tuple[int, float]] = []  # (signal, when): the first one counts


def _say(text: str) -> None:
    # Timed to the hundredth: the output file is appended by every allocation, and preemption is a matter of seconds.
    now = time.time()
    print(
        f"[slurm_batch] {time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 100) % 100:02d} {text}", flush=True
    )


def allocated(job: StageJob, nodelist: str) -> StageJob:
    """The job placed on this allocation: for several nodes, TRAINGATE_NODES names them and the
    rendezvous moves to the first node's address (the spec's endpoint keeps only its port)."""
    names = slurm_cli.hostnames(nodelist)
    if len(names) != job.nodes:
        raise SlurmError(f"allocation {nodelist!r} has {len(names)} nodes, the stage needs {job.nodes}")
    if job.nodes == 1:
        return job
    os.environ[NODES_VAR] = "slurm:" + ",".join(names)
    addr = slurm_cli.node_addresses()[names[0]]
    port = (job.spec.resources.rdzv_endpoint or ":29500").rpartition(":")[2]
    spec = job.spec.with_overrides([f"resources.rdzv_endpoint={addr}:{port}"])
    return dataclasses.replace(job, spec=spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m traingate.ladder.slurm_batch", description=__doc__.split("\n")[0])
    parser.add_argument("--job", required=True, help="the stage's slurm_job.json")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted supervision of the stage")
    parser.add_argument(
        "--zygote", help="PID:DIR of the stage's zygote, started ahead (python -m traingate.runtime.warm --ahead)"
    )
    args = parser.parse_args(argv)

    def on_term(sig: int, _frame: object) -> None:
        # Slurm may deliver the preemption signal twice: the first one counts.
        if not _signalled:
            request_stop(
                f"{SIGNALLED} ({signal.Signals(sig).name}, job {os.environ.get('SLURM_JOB_ID')}): "
                "preempted, or cancelled"
            )
        _signalled.append((sig, time.time()))

    signal.signal(signal.SIGTERM, on_term)
    job = StageJob.read(args.job)
    zygote = adopt_zygote(job, args.zygote) if args.zygote else None
    job_id = os.environ.get("SLURM_JOB_ID", "")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    stage_dir = Path(job.stage_dir)
    _say(
        f"job {job_id} on {os.environ.get('SLURM_JOB_NODELIST')}: {job.stage} of run {job.run_id}"
        + (f", allocation {restarts + 1} (requeued {restarts}x)" if restarts else "")
    )
    # Start-up is latency a stage pays on every allocation (a slow shared filesystem shows here); bench reads it.
    started = psutil.Process().create_time()
    _say(f"python started at {started:.2f} (epoch s), ready {time.time() - started:.2f} s later")
    try:
        job = allocated(job, os.environ.get("SLURM_JOB_NODELIST", ""))
    except SlurmError as e:
        _say(str(e))
        if zygote is not None:
            zygote.stop()
        return 2
    previous = read_state(stage_dir) if (args.resume or restarts) else None
    hooks = Hooks(on_line=print, info=_say, stop_requested=stop_request)
    before: list[Supervision] = []
    sup = stage_run.train(job, hooks, previous, _say, before, zygote)
    stopped = time.time()
    if before:
        # Smoke's first half ran in this allocation: its attempts go into supervisor.json ahead of the second
        # half's, which is what the orchestrator reads back (the stage's attempt records and restarts).
        state = read_state(stage_dir)
        if state is not None:
            state.attempts = [dataclasses.asdict(a) for b in before for a in b.attempts] + state.attempts
            files.write_supervisor_state(stage_dir, state)
    _say(f"{job.stage}: {sup.status}" + (f": {sup.error.splitlines()[0]}" if sup.error else ""))
    if sup.status == Status.PREEMPTED and _signalled and not (stage_dir / STOP_FILE).exists():
        # Preempted by Slurm: the emergency checkpoint is written; come back in a new allocation. An admin's
        # scancel signals the same way and Slurm would requeue that job too: only a preemption is requeued.
        try:
            show = slurm_cli.show_job(job_id)
            job_state = re.search(r"\bJobState=(\S+)", show)
            _say(
                f"signalled at {_signalled[0][1]:.2f}, tree stopped at {stopped:.2f} (epoch s); Slurm shows job "
                f"{job_id} {job_state.group(1) if job_state else 'without a state'}"
            )
            if slurm.preempted(show):
                slurm_cli.requeue(job_id)
                _say(
                    f"preempted: requeued job {job_id} at {time.time():.2f} (epoch s); the next allocation resumes "
                    "from the checkpoint"
                )
            else:
                # No PreemptTime: an admin's scancel, the time limit, or a preemption without GraceTime, which
                # Slurm requeues itself under PreemptMode=REQUEUE (the state above tells them apart afterwards).
                _say(f"signalled, not preempted (scancel or the time limit): job {job_id} not requeued")
        except SlurmError as e:
            _say(f"not requeued: {e}")
    return 0 if sup.status in (Status.COMPLETED, Status.PREEMPTED) else 1


if __name__ == "__main__":
    sys.exit(main())
