"""A full stage on two hosts (network namespaces, 1 process each) under the real supervisor.

Real torchrun agents, one per namespace, joined by c10d rendezvous on host a's address; real gloo
collectives over the veth pair; checkpoints and heartbeats in the shared stage directory.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from tgtest import TINY_DIGITS
from traingate.job import files
from traingate.job.stagejob import derive
from traingate.job.vocab import Cause, Status
from traingate.launch.nodes import NODES_VAR
from traingate.settings import Settings
from traingate.spec import apply_overrides, parse_spec
from traingate.supervision.drill import _weights, compare_states, final_state
from traingate.supervision.supervisor import Hooks, Supervision, supervise

pytestmark = pytest.mark.slow

STEPS = 30
KILL_AT = 12   # host b is lost once a rank reports this step (checkpoints every 5 steps)


@dataclass
class Run:
    sup: Supervision
    checkpoint_uri: str
    stage_dir: Path
    log: list[str]
    seconds: float


def _spec(hosts) -> Any:
    tree = yaml.safe_load(TINY_DIGITS)
    return parse_spec(apply_overrides(tree, [
        "resources.nodes=2", "resources.procs_per_node=1", f"resources.rdzv_endpoint={hosts.addr_a}:29411",
        f"stages.full.max_steps={STEPS}", "checkpoint.every_steps=5", "tracking.enabled=false",
        "supervision.backoff_base_s=0.2", "supervision.backoff_max_s=1.0", "supervision.hang_timeout_s=4",
        "supervision.preempt_grace_s=10"]))


@pytest.fixture(scope="module")
def two_host_run(hosts, tmp_path_factory) -> Callable[..., Run]:
    root = tmp_path_factory.mktemp("two-hosts")
    mp = pytest.MonkeyPatch()
    mp.setenv(NODES_VAR, hosts.nodes_var)

    def run(name: str, on_tick: Callable[[Path], None] | None = None,
            stop_requested: Callable[[Path], str | None] | None = None) -> Run:
        # A disturbed run is paced (rank 0 sleeps 0.1 s a step: 3 s in all) so that the disturbance,
        # polled every supervisor tick, lands mid-stage; unpaced, 30 tiny steps can end before it.
        paced = on_tick is not None or stop_requested is not None
        job = derive(_spec(hosts), "full", run_id=name, run_dir=root / name, settings=Settings.from_env(),
                     checkpoint_uri=(root / name / "checkpoints").as_uri(), faults="slow@0:0" if paced else None)
        log: list[str] = []
        stage_dir = Path(job.stage_dir)
        t0 = time.monotonic()
        sup = supervise(job, Hooks(info=log.append, on_tick=(lambda: on_tick(stage_dir)) if on_tick else None,
                                   stop_requested=(lambda: stop_requested(stage_dir)) if stop_requested else None),
                        seed=0)
        return Run(sup, job.checkpoint_uri, stage_dir, log, time.monotonic() - t0)

    yield run
    mp.undo()


@pytest.fixture(scope="module")
def undisturbed(two_host_run) -> Run:
    return two_host_run("undisturbed")


def _rank_on(hosts, ns: str, stage_dir: Path) -> tuple[int, int]:
    """(rank, pid) of the training process running in namespace ``ns``."""
    pids = set(hosts.pids(ns))
    for rank, beat in files.read_heartbeats(stage_dir).items():
        if beat.pid in pids:
            return rank, beat.pid
    raise AssertionError(f"no rank's heartbeat names a process of {ns}")


def _at_step(stage_dir: Path, step: int) -> bool:
    return any(b.step >= step for b in files.read_heartbeats(stage_dir).values())


def test_two_hosts_one_process_each_complete_the_full_stage(undisturbed, hosts):
    run = undisturbed
    assert run.sup.status == Status.COMPLETED, run.sup.error
    assert run.sup.restarts == 0
    launch = next(line for line in run.log if "launch 1:" in line)
    assert "traingate.launch.nodes" in launch and "--nnodes=2" in launch
    out = (run.stage_dir / files.STDOUT).read_text()
    assert f"node 0 ({hosts.a}, {hosts.addr_a})" in out and f"node 1 ({hosts.b}, {hosts.addr_b})" in out
    assert final_state(run.checkpoint_uri)["train_state"]["step"] == STEPS


def test_losing_host_b_mid_stage_recovers_and_ends_bitwise_equal_to_the_undisturbed_run(
        two_host_run, undisturbed, hosts):
    killed: list[int] = []

    def lose_host_b(stage_dir: Path) -> None:
        if not killed and _at_step(stage_dir, KILL_AT):
            killed.extend(hosts.pids(hosts.b))   # its agent and its worker: the whole host
            for pid in killed:
                os.kill(pid, signal.SIGKILL)

    run = two_host_run("host-b-lost", lose_host_b)
    assert killed, "host b was never killed"
    assert run.sup.status == Status.COMPLETED, run.sup.error
    first, *rest = run.sup.attempts
    assert first.cause == Cause.WORKER_LOST and first.retryable
    # Resumed from a periodic checkpoint, not from 0 (which one depends on how far the kill lagged step 12).
    assert rest and 0 < rest[0].start_step < STEPS and rest[0].start_step % 5 == 0, rest[0]
    out = (run.stage_dir / files.STDOUT).read_text()
    assert f"node 1 ({hosts.b}) lost" in out
    assert compare_states(_weights(final_state(undisturbed.checkpoint_uri)),
                          _weights(final_state(run.checkpoint_uri))) == []


def test_a_stopped_rank_on_host_b_is_detected_as_a_hang_and_the_stage_recovers(two_host_run, undisturbed, hosts):
    stopped: list[tuple[int, float]] = []   # (rank, when)

    def stop_rank_on_b(stage_dir: Path) -> None:
        if not stopped and _at_step(stage_dir, KILL_AT):
            rank, pid = _rank_on(hosts, hosts.b, stage_dir)
            os.kill(pid, signal.SIGSTOP)
            stopped.append((rank, time.time()))

    run = two_host_run("rank-on-b-hung", stop_rank_on_b)
    assert stopped, "no rank on host b was stopped"
    assert run.sup.status == Status.COMPLETED, run.sup.error
    first = run.sup.attempts[0]
    assert first.cause == Cause.HANG and "stuck at step" in first.detail, (first.cause, first.detail)
    # Its peer on host a blocks in the next collective, so either rank may be named; what matters is
    # that host b's heartbeats reached the supervisor: without them the verdict would have waited for
    # supervision.startup_timeout_s (300 s) and said "wrote no heartbeat".
    rank_b, when = stopped[0]
    assert rank_b in first.start_steps
    assert first.ended_at - when < 4 + 10, f"hang seen {first.ended_at - when:.1f} s after the stop (timeout 4 s)"
    assert compare_states(_weights(final_state(undisturbed.checkpoint_uri)),
                          _weights(final_state(run.checkpoint_uri))) == []


def test_cancelling_a_two_host_stage_checkpoints_on_both_hosts_and_ends_preempted(two_host_run, hosts):
    def cancel_mid_stage(stage_dir: Path) -> str | None:
        return "cancelled from the UI" if _at_step(stage_dir, KILL_AT) else None

    run = two_host_run("cancelled", stop_requested=cancel_mid_stage)
    assert run.sup.status == Status.PREEMPTED and run.sup.restarts == 0, run.sup.error
    assert "emergency checkpoint written" in run.sup.error
    step = final_state(run.checkpoint_uri)["train_state"]["step"]
    assert KILL_AT <= step < STEPS
    out = (run.stage_dir / files.STDOUT).read_text()
    for rank in (0, 1):   # the ranks on both hosts agreed on the step of the emergency checkpoint
        assert f"[rank {rank}] SIGTERM: writing emergency checkpoint at step {step}" in out
    assert "stopping on request" in out and " lost: " not in out
