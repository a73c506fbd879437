"""The Slurm test cluster is a real one: nodes, accounting, limits, preemption, rights, torchrun.

Jobs write only under the cluster's shared directory; each test leaves the cluster as it found it
(the `slurm` fixture cancels jobs and lifts caps).
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from slurm.cluster import SlurmCluster, User


def _run(cmd: list[str], user: User | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    if user is not None:
        return user.run(cmd, cwd=str(cwd or user.home))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)


def _sbatch(*args: str, workdir: Path, user: User | None = None) -> int:
    r = _run(["sbatch", "--parsable", f"--chdir={workdir}", f"--output={workdir}/%j.out", *args],
             user=user, cwd=workdir)
    assert r.returncode == 0, r.stdout + r.stderr
    return int(r.stdout.strip().split(";")[0])


def _squeue_job(job_id: int) -> dict | None:
    # squeue ignores -j in JSON mode: filter here.
    jobs = json.loads(_run(["squeue", "--json"]).stdout)["jobs"]
    return next((j for j in jobs if j["job_id"] == job_id), None)


def _sacct_job(job_id: int) -> dict | None:
    jobs = json.loads(_run(["sacct", "--json", "-j", str(job_id)]).stdout)["jobs"]
    return next((j for j in jobs if j["job_id"] == job_id), None)


def _wait(pred, timeout: float, what):
    """Poll `pred` until truthy; `what` (a string, or a callable for a message read at the timeout) names it."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(0.2)


def _wait_state(job_id: int, states: tuple[str, ...], timeout: float = 30) -> dict:
    def reached():
        job = _squeue_job(job_id)
        return job if job is not None and job["job_state"] in states else None
    return _wait(reached, timeout, lambda: f"job {job_id} in {states}, squeue has {_squeue_job(job_id)}")


def _wait_sacct_state(job_id: int, state: str, timeout: float = 30) -> dict:
    def reached():
        job = _sacct_job(job_id)
        return job if job is not None and job["state"]["current"] == state else None
    return _wait(reached, timeout, lambda: f"job {job_id} {state} in sacct, which has {_sacct_job(job_id)}")


def test_two_nodes_are_idle_with_two_a100_gpus_each_at_their_namespace_addresses(slurm: SlurmCluster):
    nodes = {n["name"]: n for n in json.loads(_run(["sinfo", "--json"]).stdout)["nodes"]}

    assert sorted(nodes) == ["n1", "n2"]
    for node in slurm.nodes:
        assert nodes[node.name]["state"] == "idle"
        assert nodes[node.name]["gres"] == "gpu:a100:2"
        assert nodes[node.name]["address"] == node.addr
        assert nodes[node.name]["partitions"] == ["gpu"]


PROBE = """\
import errno, json, os, pwd, subprocess, sys, tempfile
devices = json.loads(sys.argv[1])[os.environ["SLURMD_NODENAME"]]
opened = {}
for dev in devices:
    try:
        os.close(os.open(dev, os.O_RDWR))
    except OSError as e:
        opened[dev] = errno.errorcode[e.errno]   # ENXIO: allowed, no driver; EPERM: fenced off
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout.split()[3]
print(json.dumps({"node": os.environ["SLURMD_NODENAME"], "user": pwd.getpwuid(os.getuid()).pw_name,
                  "uid": os.getuid(), "addr": addr.split("/")[0], "open": opened,
                  "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "tmp": tempfile.gettempdir()}), flush=True)
"""


def test_two_node_job_runs_as_its_user_on_both_nodes_with_one_fenced_gpu_each_and_completes_in_sacct(
        slurm: SlurmCluster):
    alice = slurm.users["tgalice"]
    work = slurm.shared_dir("two-node")
    (work / "probe.py").write_text(PROBE)
    devices = json.dumps({n.name: list(n.gpu_devices) for n in slurm.nodes})

    job = _sbatch("--account=vision", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1",
                  "--wrap", f"srun python {work}/probe.py '{devices}'", workdir=work, user=alice)
    # sacct may first show a COMPLETED record with only the batch host as its nodes.
    done = _wait(lambda: (j := _sacct_job(job)) and j["state"]["current"] == "COMPLETED" and j["nodes"] == "n[1-2]"
                 and j, 30, f"job {job} COMPLETED on n[1-2] in sacct")

    probes = {p["node"]: p for p in map(json.loads, (work / f"{job}.out").read_text().splitlines())}
    assert sorted(probes) == ["n1", "n2"]
    for node in slurm.nodes:
        probe = probes[node.name]
        assert (probe["user"], probe["uid"]) == ("tgalice", alice.uid)
        assert probe["addr"] == node.addr
        assert probe["cuda"] == "0"
        assert sorted(probe["open"].values()) == ["ENXIO", "EPERM"], probe   # its one GPU, the other fenced
        assert probe["tmp"] == str(slurm.base / "jobtmp" / str(job))
    assert (done["user"], done["account"]) == ("tgalice", "vision")
    _wait(lambda: not (slurm.base / "jobtmp" / str(job)).exists(), 10, "the epilog to remove the job's TMPDIR")


def test_job_over_the_account_gpu_cap_pends_with_AssocGrpGRES_until_the_cap_is_lifted(slurm: SlurmCluster):
    bob = slurm.users["tgbob"]
    slurm.set_grp_gpus("language", 1)

    job = _sbatch("--account=language", "--gpus-per-node=2", "--wrap", "sleep 60",
                  workdir=slurm.shared_dir("cap"), user=bob)
    pending = _wait(lambda: (j := _squeue_job(job)) and j["state_reason"] == "AssocGrpGRES" and j,
                    15, "the capped job to pend on AssocGrpGRES")
    assert pending["job_state"] == "PENDING"

    slurm.set_grp_gpus("language", None)
    _wait_state(job, ("RUNNING",))


VICTIM = """\
#!/bin/bash
trap 'echo TERM >> {work}/signals; exit 0' TERM
echo started >> {work}/signals
while true; do sleep 1 & wait; done
"""


def _preempt(slurm: SlurmCluster, work: Path) -> tuple[int, int]:
    (work / "victim.sh").write_text(VICTIM.format(work=work))
    victim = _sbatch("--account=vision", "--qos=research", "--nodes=2", "--gpus-per-node=2", "--requeue",
                     "--signal=B:TERM@600", str(work / "victim.sh"), workdir=work)
    _wait_state(victim, ("RUNNING",))
    _wait(lambda: (work / "signals").exists(), 15, "the victim's script to start")
    urgent = _sbatch("--account=language", "--qos=urgent", "--gpus-per-node=1", "--wrap", "sleep 60", workdir=work)
    return victim, urgent


def test_urgent_job_preempts_a_research_job_which_is_signalled_and_requeued(slurm: SlurmCluster):
    work = slurm.shared_dir("preempt")
    victim, urgent = _preempt(slurm, work)

    _wait_state(urgent, ("RUNNING",))
    requeued = _wait_state(victim, ("PENDING",))
    assert requeued["restart_cnt"] == 1
    # The victim exits on SIGTERM, as a job that checkpoints then would, and is requeued all the same. (A
    # --signal other than TERM is not always delivered: slurmd may handle the preemption's kill first.) The
    # preemption's signal and its kill are both SIGTERM: the second can come while the trap still runs.
    started, *signals = (work / "signals").read_text().split()
    assert started == "started" and signals and set(signals) == {"TERM"}, signals


def test_preempt_mode_cancel_ends_the_victim_instead_of_requeueing_it(slurm: SlurmCluster):
    slurm.set_preempt_mode("CANCEL")
    work = slurm.shared_dir("preempt-cancel")
    victim, urgent = _preempt(slurm, work)

    _wait_state(urgent, ("RUNNING",))
    ended = _wait_state(victim, ("PREEMPTED",))
    assert ended["restart_cnt"] == 0
    _wait_sacct_state(victim, "PREEMPTED")


def test_tgbob_cannot_submit_to_vision_nor_use_qos_urgent(slurm: SlurmCluster):
    bob = slurm.users["tgbob"]
    work = slurm.shared_dir("rights")

    foreign = _run(["sbatch", "--account=vision", f"--chdir={work}", "--wrap", "true"], user=bob)
    urgent = _run(["sbatch", "--account=language", "--qos=urgent", f"--chdir={work}", "--wrap", "true"], user=bob)

    assert foreign.returncode == 1
    assert "Invalid account or account/partition combination specified" in foreign.stderr
    assert urgent.returncode == 1
    assert "Invalid qos specification" in urgent.stderr


def test_time_limit_over_the_partition_max_is_refused_at_submit(slurm: SlurmCluster):
    r = _run(["sbatch", "--account=vision", "--time=2:00:01", f"--chdir={slurm.shared_dir('time')}",
              "--wrap", "true"])

    assert r.returncode == 1
    assert "Requested time limit is invalid" in r.stderr


def test_a_running_job_survives_a_controller_restart(slurm: SlurmCluster):
    work = slurm.shared_dir("restart")
    job = _sbatch("--account=vision", "--wrap", "sleep 60", workdir=work)
    _wait_state(job, ("RUNNING",))
    before = slurm.pids()["slurmctld"]

    slurm.restart_controller()

    assert slurm.pids()["slurmctld"] != before
    assert _squeue_job(job)["job_state"] == "RUNNING"


def test_a_killed_node_daemon_registers_again_when_started(slurm: SlurmCluster):
    def started_at() -> int:
        nodes = json.loads(_run(["sinfo", "--json"]).stdout)["nodes"]
        return next(n["slurmd_start_time"] for n in nodes if n["name"] == "n2")
    before = started_at()
    pid = slurm.pids()["slurmd-n2"]

    slurm.kill_node("n2")
    assert "slurmd-n2" not in slurm.pids() and not Path(f"/proc/{pid}/cmdline").exists()
    time.sleep(1.1)   # slurmd_start_time has a resolution of one second
    slurm.start_node("n2")

    _wait(lambda: started_at() > before, 15, "n2's slurmd to register again")


ALL_REDUCE = """\
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {os.environ['SLURMD_NODENAME']}: {t.item():g}", flush=True)
dist.destroy_process_group()
"""

# Every node namespace has the same hostname (it resolves to 127.0.0.1): torchrun is given the
# addresses, the rendezvous is hosted by the first node only, gloo talks over eth0.
TORCHRUN_JOB = """\
#!/bin/bash
srun --kill-on-bad-exit=1 bash -c '
addr() {{ scontrol show node "$1" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p"; }}
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
is_host=0; [ "$SLURMD_NODENAME" = "$first" ] && is_host=1
export GLOO_SOCKET_IFNAME=eth0
exec torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint="$(addr "$first"):29411" \\
  --rdzv-id="$SLURM_JOB_ID" --local-addr="$(addr "$SLURMD_NODENAME")" --rdzv-conf=is_host=$is_host \\
  {script}'
"""


def test_torchrun_gloo_all_reduce_spans_both_node_namespaces_under_srun(slurm: SlurmCluster):
    alice = slurm.users["tgalice"]
    work = slurm.shared_dir("torchrun")
    (work / "all_reduce.py").write_text(ALL_REDUCE)
    (work / "job.sh").write_text(TORCHRUN_JOB.format(script=work / "all_reduce.py"))

    job = _sbatch("--account=vision", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1", "--time=5",
                  str(work / "job.sh"), workdir=work, user=alice)
    _wait_sacct_state(job, "COMPLETED", timeout=90)

    lines = sorted(line for line in (work / f"{job}.out").read_text().splitlines() if line.startswith("rank "))
    assert lines == ["rank 0 of 2 on n1: 3", "rank 1 of 2 on n2: 3"]
