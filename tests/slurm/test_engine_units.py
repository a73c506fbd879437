"""The Slurm engine's mapping, on JSON and text the real Slurm 22.05 test cluster printed (tests/slurm/data)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tgtest import PYTHON, TINY_DIGITS
from traingate.capacity import slurm
from traingate.capacity.pools import SlurmPool
from traingate.capacity.slurm import AccountedJob, Ending, SlurmError
from traingate.supervision.slurm_result import after_end
from traingate.job import files
from traingate.job.stagejob import derive
from traingate.job.vocab import Status
from traingate.settings import Settings
from traingate.spec import parse_spec

DATA = Path(__file__).parent / "data"
POOL = SlurmPool(partition="gpu", gres_type="a100", sbatch_args=["--constraint=ib"])


def _job(tmp_path: Path, stage: str = "full", **resources):
    tree = yaml.safe_load(TINY_DIGITS)
    tree["identity"]["team"] = "vision"
    tree["resources"] = {"work_pool": "slurm-gpu", "nodes": 2, "procs_per_node": 2, "rdzv_endpoint": "n1:29512",
                         "priority": "production", **resources}
    tree["pools"] = {"slurm-gpu": {"price_per_gpu_hour": 1.0, "gpus_per_node": 2}}
    return derive(parse_spec(tree), stage, run_id="r1", run_dir=tmp_path / "r1",
                  settings=Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path)}))


def test_the_sbatch_command_maps_team_class_nodes_and_gpus_and_runs_the_batch_step_in_the_stage_dir(tmp_path):
    job = _job(tmp_path)
    cmd = slurm.sbatch_command(job, POOL, python="/venv/bin/python", time_limit_s=125, grace_s=30, resume=True)
    stage_dir = Path(job.stage_dir)
    assert cmd[:2] == ["sbatch", "--parsable"]
    for opt in ("--partition=gpu", "--nodes=2", "--ntasks-per-node=1", "--gres=gpu:a100:2", "--account=vision",
                "--qos=production", "--time=3", "--requeue", "--signal=B:TERM@30", "--job-name=tg-r1-full",
                f"--output={stage_dir}/slurm-%j.out", f"--chdir={stage_dir}", "--constraint=ib"):
        assert opt in cmd, opt
    assert cmd[-1] == (f"--wrap=exec /venv/bin/python -m traingate.ladder.slurm_batch --job "
                       f"{stage_dir}/slurm_job.json --resume")
    assert "--gres=gpu:2" in slurm.sbatch_command(job, SlurmPool(partition="gpu"), python="p", time_limit_s=60,
                                                  grace_s=5)
    # a warm stage's zygote starts first and execs into the batch step (same pid: the signal still reaches it)
    warm = slurm.sbatch_command(job, POOL, python="p", time_limit_s=60, grace_s=5, zygote_log="/s/zygote.log")
    assert warm[-1] == f"--wrap=exec p -m traingate.runtime.warm --ahead /s/zygote.log p -m traingate.ladder.slurm_batch " \
                       f"--job {stage_dir}/slurm_job.json"


def test_the_time_limit_comes_from_the_canarys_step_time_and_is_refused_over_the_partitions_max_time(tmp_path):
    job = _job(tmp_path)  # full: 16 steps, timeout 3600 s
    max_time = slurm.partition_max_time((DATA / "show_partition.txt").read_text())
    assert max_time == 7200
    assert slurm.time_limit_s(job, 2.0, 6, max_time) == 2.0 * 10 * slurm.TIME_MARGIN + slurm.START_S
    assert slurm.time_limit_s(job, None, 0, max_time) == job.timeout_s
    assert slurm.time_limit_s(job, None, 0, 600) == 600
    with pytest.raises(SlurmError) as e:
        slurm.time_limit_s(job, 600.0, 0, max_time)
    assert "partition MaxTime is 7200 s" in str(e.value) and "stages.full.max_steps" in str(e.value)
    assert "\n" not in str(e.value)


def test_squeue_json_gives_state_reason_and_slurms_start_estimate_filtered_by_job_id():
    text = (DATA / "squeue_running_pending.json").read_text()
    running = slurm.queued_job(text, "10600000")
    pending = slurm.queued_job(text, "10600001")
    assert (running.state, running.nodes, running.node_count, running.account) == ("RUNNING", "n[1-2]", 2, "vision")
    assert (pending.state, pending.reason, pending.nodes) == ("PENDING", "Resources", "")
    assert pending.start_time > pending.submit_time  # Slurm's estimate
    assert slurm.queued_job(text, "999") is None
    limits = {j.job_id: j.reason for j in slurm.queued_jobs((DATA / "squeue_limits.json").read_text()) if j.pending}
    assert set(limits.values()) == {"PartitionNodeLimit", "PartitionTimeLimit"} <= set(slurm.NEVER_STARTS)


def test_sinfo_json_gives_each_nodes_address_state_and_gpus_and_scontrol_the_node_addresses():
    views = slurm.nodes((DATA / "sinfo_idle.json").read_text(), "gpu")
    assert [(v.name, v.state, v.gres) for v in views] == [("n1", "idle", "gpu:a100:2"), ("n2", "idle", "gpu:a100:2")]
    addrs = slurm.node_addresses((DATA / "show_node.txt").read_text())
    assert addrs == {v.name: v.addr for v in views}
    assert slurm.nodes((DATA / "sinfo_idle.json").read_text(), "other") == []


def test_sacct_json_gives_the_final_state_exit_code_signal_and_elapsed_time():
    done = slurm.accounted_job((DATA / "sacct_completed.json").read_text(), "10600001")
    assert (done.state, done.exit_code, done.elapsed_s) == ("COMPLETED", 0, 5)
    killed = slurm.accounted_job((DATA / "sacct_preempted_exited.json").read_text(), "10600000")
    assert (killed.state, killed.exit_code, killed.signal) == ("FAILED", None, 15)
    cancelled = slurm.accounted_job((DATA / "sacct_cancelled.json").read_text(), "10600003")
    assert slurm.ending(cancelled.state) == Ending.CANCELLED
    with pytest.raises(SlurmError):
        slurm.accounted_job('{"errors": [{"description": "Unable to contact slurmdbd"}], "jobs": []}', "1")


@pytest.mark.parametrize("state, ending", [
    ("PENDING", None), ("RUNNING", None), ("COMPLETING", None), ("REQUEUED", None), ("COMPLETED", Ending.COMPLETED),
    ("FAILED", Ending.FAILED), ("CANCELLED", Ending.CANCELLED), ("PREEMPTED", Ending.PREEMPTED),
    ("NODE_FAIL", Ending.NODE_LOST), ("TIMEOUT", Ending.TIMEOUT), ("OUT_OF_MEMORY", Ending.OOM),
])
def test_job_states_map_to_endings_and_live_states_to_none(state, ending):
    assert slurm.ending(state) == ending


@pytest.mark.parametrize("stderr, names", [
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
     ["account 'vision' (identity.team)", "sacctmgr add user"]),
    ("sbatch: error: Batch job submission failed: Invalid qos specification",
     ["QOS 'production' (resources.priority)", "qos+=production"]),
    ("sbatch: error: invalid partition specified: nopart\nsbatch: error: Batch job submission failed: Invalid "
     "partition name specified", ["partition 'gpu' (the pool's slurm.partition)"]),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available",
     ["2 node(s) with gpu:a100:2", "resources.nodes"]),
])
def test_an_sbatch_refusal_is_one_line_naming_the_value_and_the_fix(tmp_path, stderr, names):
    line = slurm.refusal(stderr, _job(tmp_path), POOL)
    assert "\n" not in line and line.startswith("sbatch refused full of run r1: ")
    for n in names:
        assert n in line, line


def _acct(state: str) -> AccountedJob:
    return AccountedJob("42", state, "None", 0, None, 100, 200, 100, "n[1-2]", 0)


def _state(status: str, stop_reason: str | None) -> files.SupervisorState:
    return files.SupervisorState(attempts=[], final={"status": status, "cause": "preempted" if status == "preempted"
                                                     else None, "error": None, "stop_reason": stop_reason})


def test_after_the_end_a_preemption_without_requeue_is_resubmitted_and_an_admins_scancel_is_cancelled(tmp_path):
    job = _job(tmp_path)
    Path(job.stage_dir).mkdir(parents=True)
    signalled = _state("preempted", f"{slurm.SIGNALLED} (SIGTERM, job 42): preempted, or cancelled")
    assert after_end(job, _acct("PREEMPTED"), signalled, False, True).resubmit
    # It checkpointed on Slurm's signal and exited, and the requeue did not happen: submit again.
    assert after_end(job, _acct("COMPLETED"), signalled, False, True).resubmit
    # Paused by an alert: stays paused.
    paused = after_end(job, _acct("COMPLETED"), _state("preempted", "gpu-ecc: ..."), False, True)
    assert not paused.resubmit and paused.sup.status == Status.PREEMPTED
    admin = after_end(job, _acct("CANCELLED"), signalled, False, True)
    assert not admin.resubmit and admin.sup.status == Status.PREEMPTED
    assert "cancelled by scancel outside traingate" in admin.sup.error
    ours = after_end(job, _acct("CANCELLED"), None, True, False)
    assert "before it started" in ours.sup.error and not ours.resubmit
    assert after_end(job, _acct("NODE_FAIL"), None, False, True).resubmit
    crashed = after_end(job, _acct("FAILED"), None, False, True)
    assert crashed.sup.status == Status.FAILED and "without a supervisor verdict" in crashed.sup.error
    done = after_end(job, _acct("COMPLETED"), _state("completed", None), False, True)
    assert done.sup.status == Status.COMPLETED and not done.resubmit
    timeout = after_end(job, _acct("TIMEOUT"), None, False, True)
    assert timeout.sup.status == Status.FAILED and "--time limit" in timeout.sup.error


def test_the_batch_step_and_its_supervisor_start_without_importing_torch():
    # Every allocation pays the batch step's imports before torchrun starts; torch alone is seconds of them.
    probe = ("import sys, traingate.ladder.slurm_batch\n"
             "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'torch'))")
    p = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]"
