"""A SIGTERM (a pause, a preemption) that reaches a rank while it is still starting, here waiting in the
rendezvous for the other rank, is honoured as one that comes mid-training: the group trains its first step,
writes the emergency checkpoint and exits "preempted" (75). On a busy machine the start takes seconds, and a
budget pause comes in them. Real training processes (python, gloo), launched by hand."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
from tgtest import PYTHON, TINY_DIGITS, free_port, write_job

from traingate.job import files
from traingate.runtime import exitcodes

pytestmark = pytest.mark.slow


def _listening(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


def test_a_sigterm_while_a_rank_waits_in_the_rendezvous_stops_the_group_at_step_one_with_an_emergency_checkpoint(
        tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY_DIGITS)
    stage_dir = tmp_path / "run" / "smoke"
    job = write_job(spec, stage_dir, run_id="stop-at-start", stage="smoke")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGATE_", "TORCHELASTIC_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    argv = [PYTHON, "-m", "traingate.runtime.train", "--job", str(job)]
    logs = [(tmp_path / f"rank{r}.log").open("w") for r in (0, 1)]
    ranks = [subprocess.Popen(argv, env={**env, "RANK": "0", "LOCAL_RANK": "0"}, stdout=logs[0],
                              stderr=subprocess.STDOUT)]
    try:
        # Rank 0 hosts the rendezvous store: once it listens, rank 0 waits in the rendezvous for rank 1.
        deadline = time.monotonic() + 180
        while not _listening(ranks[0].pid, port):
            assert ranks[0].poll() is None, (tmp_path / "rank0.log").read_text()
            assert time.monotonic() < deadline, "rank 0 never opened the rendezvous"
            time.sleep(0.05)
        ranks[0].send_signal(signal.SIGTERM)
        ranks.append(subprocess.Popen(argv, env={**env, "RANK": "1", "LOCAL_RANK": "1"}, stdout=logs[1],
                                      stderr=subprocess.STDOUT))
        codes = [ranks[0].wait(timeout=300)]  # a rank 0 killed by the SIGTERM fails here, rank 1 is not awaited
        if codes[0] == exitcodes.PREEMPTED:
            codes.append(ranks[1].wait(timeout=300))
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait()
        for f in logs:
            f.close()
    said = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    assert codes == [exitcodes.PREEMPTED, exitcodes.PREEMPTED], (codes, said)
    result = files.read_result(stage_dir)
    assert result is not None and result.steps_done == 1 and result.last_checkpoint_step == 1, (result, said)
