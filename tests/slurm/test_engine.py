"""The Slurm capacity engine end to end on a real Slurm 22.05 cluster (tests/slurm/cluster.py): two nodes in
network namespaces with two fake a100 GPUs each, real sbatch/squeue/sacct/scontrol, real torchrun across the
nodes, a real Prefect server (test harness) and MLflow store.

Stages are tiny digits models; a preempted stage resumes from its emergency checkpoint and ends with
weights bitwise equal to the same stage never preempted.
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tgtest import PYTHON, TINY_DIGITS
from traingate.capacity import slurm as tslurm
from traingate.capacity.pools import parse_config
from traingate.job.stagejob import derive
from traingate.job.vocab import Status
from traingate.settings import Settings

BIN = Path(PYTHON).parent
POOL = "slurm-gpu"
POOLS = {"pools": {POOL: {"gpu": "A100-80GB", "gpus_per_node": 2, "nodes": 2, "price_per_gpu_hour": 1.0,
                          "worker": "process", "engine": "slurm",
                          "slurm": {"partition": "gpu", "gres_type": "a100"}}}}


class Log:
    """The launch task's logger, kept: what the engine said, in order."""

    def __init__(self):
        self.lines: list[str] = []

    def _add(self, msg, *args):
        self.lines.append(msg % args if args else msg)

    info = warning = error = _add

    def text(self) -> str:
        return "\n".join(self.lines)


def _tree(nodes: int = 2, steps: int = 16, priority: str = "research", team: str = "vision") -> dict:
    tree = yaml.safe_load(TINY_DIGITS)
    tree["identity"]["team"] = team
    tree["resources"] = {"work_pool": POOL, "nodes": nodes, "procs_per_node": 2, "priority": priority,
                         **({"rdzv_endpoint": "n1:29512"} if nodes > 1 else {})}
    tree["pools"] = {POOL: {"price_per_gpu_hour": 1.0, "gpus_per_node": 2}}
    tree["stages"]["full"] = {"max_steps": steps}
    tree["checkpoint"] = {"every_steps": 10}
    return tree


def _job(state: Path, run_id: str, tree: dict, faults: str | None = None):
    from traingate.spec import parse_spec

    tree = {**tree, "tracking": {"enabled": False}}
    return derive(parse_spec(tree), "full", run_id=run_id, run_dir=state / "runs" / run_id,
                  settings=Settings.from_env({"TRAINGATE_STATE_DIR": str(state)}), faults=faults)


def _start(job, stop: threading.Event | None = None, resume: bool = False):
    """run_on_slurm in a thread (the launch task's body); returns (thread, box with 'result', log)."""
    from tasks.slurm import run_on_slurm

    pool = parse_config(POOLS).pools[POOL]
    box: dict = {}
    log = Log()
    stopping = (lambda: "flow run is cancelling" if stop.is_set() else None) if stop else (lambda: None)
    t = threading.Thread(target=lambda: box.update(result=run_on_slurm(job, pool, resume, stopping, log)),
                         daemon=True)
    t.start()
    return t, box, log


def _slurm_id(job, timeout: float = 60) -> str:
    path = Path(job.stage_dir) / tslurm.RECORD_FILE
    _wait(lambda: path.exists(), "the job's submission", timeout)
    return json.loads(path.read_text())["jobs"][-1]["id"]


def _step(job) -> int:
    p = Path(job.stage_dir) / "heartbeat.rank0.json"
    try:
        return json.loads(p.read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


def _wait(cond, what: str, timeout: float = 180, log: Log | None = None):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}" + (f"; log:\n{log.text()}" if log else "")
        time.sleep(0.3)


def _squeue(jid: str):
    return tslurm.queued_job(subprocess.run(["squeue", "--json"], capture_output=True, text=True).stdout, jid)


def _sacct(jid: str):
    return tslurm.accounted_job(subprocess.run(["sacct", "-j", jid, "--json"], capture_output=True,
                                               text=True).stdout, jid)


class Twin:
    """The stage both preemption tests compare against: the same 60 steps on one node, never preempted.

    Started by the first test that needs it (on the node its victim leaves free) and joined by that
    test, before the cluster's per-test reset would cancel it; later tests read its final weights."""

    def __init__(self, state: Path):
        self.job = _job(state, "reference", _tree(nodes=1, steps=60))
        self.thread: threading.Thread | None = None
        self.box: dict = {}
        self.log = Log()
        self._weights: dict | None = None

    def start(self) -> None:
        if self.thread is None:
            self.thread, self.box, self.log = _start(self.job)

    def weights(self) -> dict:
        from traingate.supervision.drill import _weights, final_state

        if self._weights is None:
            self.start()
            assert self.thread is not None
            self.thread.join(400)
            result = self.box.get("result")
            assert result is not None and result.status == Status.COMPLETED, self.log.text()
            self._weights = _weights(final_state(self.job.checkpoint_uri))
        return self._weights


@pytest.fixture(scope="module")
def unpreempted(tmp_path_factory) -> Twin:
    return Twin(tmp_path_factory.mktemp("unpreempted") / "state")


@pytest.fixture
def slurm_pools(prefect_harness):
    """The harness server carries a capacity config with the Slurm pool (and loses it after the test)."""
    from prefect import get_client

    from tasks import slots

    with get_client(sync_client=True) as c:
        slots.put_variable(c, slots.CONFIG_VAR, parse_config(POOLS).model_dump(mode="json"))
    yield
    with get_client(sync_client=True) as c:
        slots.delete_variable(c, slots.CONFIG_VAR)


def test_the_ladder_climbs_on_a_slurm_pool_with_the_full_stage_on_both_nodes(slurm, slurm_pools, state_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import pipeline

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(_tree()))
    state = pipeline(str(spec), [], "full", return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert list(summary["stages"]) == ["unit", "smoke", "canary", "full"]
    full_dir = state_dir / "runs" / summary["run_id"] / "full"
    record = json.loads((full_dir / tslurm.RECORD_FILE).read_text())
    jid = record["jobs"][-1]["id"]
    acct = _sacct(jid)
    assert (acct.state, acct.nodes) == ("COMPLETED", "n[1-2]")  # one Slurm job over both nodes
    out = next(full_dir.glob("slurm-*.out")).read_text()
    assert "node 0 (n1" in out and "node 1 (n2" in out, out[-3000:]
    client = MlflowClient(Settings.from_env().tracking_uri)
    run = client.get_run(summary["stages"]["full"]["mlflow_run_id"])
    assert run.data.tags["traingate.slurm_job_id"] == jid
    assert run.data.metrics["stage.world_size"] == 4 and run.data.metrics["stage.steps"] == 16
    # Added latency: Slurm's start of the job -> the first training step, beside Slurm's own submit -> start.
    sup = json.loads((full_dir / "supervisor.json").read_text())
    first_step = sup["attempts"][0]["first_step_time"]
    print(f"\nfull stage on 2 Slurm nodes: submit -> Slurm start {acct.start - record['jobs'][-1]['submitted']:.1f} s,"
          f" Slurm start -> first training step {first_step - acct.start:.1f} s")


def test_an_over_quota_stage_shows_slurms_pending_reason_in_traingate_queue_and_a_cancel_while_pending_starts_nothing(
        slurm, slurm_pools, tmp_path, capsys):
    import argparse

    from flows.cli import queue

    slurm.set_grp_gpus("vision", 2)
    job = _job(tmp_path / "state", "quota", _tree(nodes=2))
    stop = threading.Event()
    t, box, log = _start(job, stop)
    jid = _slurm_id(job)
    _wait(lambda: (q := _squeue(jid)) is not None and q.reason == "AssocGrpGRES", "the AssocGrpGRES pending reason")
    assert queue.main(argparse.Namespace(pool=POOL)) == 0
    shown = capsys.readouterr().out
    assert f"pool {POOL} (Slurm partition gpu): 0 running, 1 pending" in shown, shown
    assert f"pending  {jid}" in shown and "(AssocGrpGRES)" in shown and "research" in shown and "vision" in shown
    stop.set()
    t.join(60)
    result = box["result"]
    assert result.status == Status.PREEMPTED and "before it started" in result.error, log.text()
    assert _sacct(jid).state == "CANCELLED" and not (Path(job.stage_dir) / "heartbeat.rank0.json").exists()


def test_an_urgent_job_preempts_a_stage_which_requeues_resumes_bitwise_equal_and_pays_for_both_allocations(
        slurm, unpreempted, tmp_path):
    """One preempted and requeued stage, two sets of facts: it resumes from its emergency checkpoint to
    weights bitwise equal to an unpreempted twin; and it is charged, from sacct -D's one record per
    allocation, for the preempted allocation beside the one that finished. The victim starts warm (each
    allocation's zygote started ahead of its batch step forks its ranks), its twin cold."""
    from traingate.cost.charged import stage_usd
    from traingate.supervision.drill import _weights, compare_states, final_state

    victim = _job(tmp_path / "state", "victim", {**_tree(nodes=1, steps=60), "supervision": {"warm_restarts": True}},
                  "slow@0")
    tv, bv, logv = _start(victim)
    vid = _slurm_id(victim)
    _wait(lambda: (q := _squeue(vid)) is not None and q.state == "RUNNING", "the victim running", log=logv)
    node = _squeue(vid).nodes
    unpreempted.start()  # the undisturbed twin, on the other node meanwhile (if no earlier test ran it)
    _wait(lambda: _step(victim) >= 15, "the victim at step 15", log=logv)
    urgent = subprocess.run(["sbatch", "--parsable", "--account=vision", "--qos=urgent", f"--nodelist={node}",
                             "--gres=gpu:a100:2", "--time=2", f"--output={tmp_path}/urgent-%j.out",
                             "--wrap", "sleep 2"], capture_output=True, text=True)
    assert urgent.returncode == 0, urgent.stderr
    tv.join(400)
    twin = unpreempted.weights()
    result = bv["result"]
    assert result.status == Status.COMPLETED, logv.text()
    assert result.metrics["slurm_requeues"] >= 1 and result.metrics["slurm_resubmits"] == 0, result.metrics
    resumed = result.metrics["resumed_from_step"]
    assert 15 <= resumed < 60, (resumed, logv.text())  # from the emergency checkpoint, not from scratch
    assert compare_states(twin, _weights(final_state(victim.checkpoint_uri))) == []
    out = next(Path(victim.stage_dir).glob("slurm-*.out")).read_text()
    assert "allocation 2 (requeued 1x)" in out, out[-3000:]
    forked = (Path(victim.stage_dir) / "zygote.log").read_text().count("forked worker")
    assert forked >= 4, forked  # both ranks, in both allocations
    sacct = subprocess.run(["sacct", "-D", "-j", vid, "--json"], capture_output=True, text=True, check=True).stdout
    held = [r for r in json.loads(sacct)["jobs"] if str(r["job_id"]) == vid and r["time"]["elapsed"] > 0]
    assert len(held) >= 2, held  # sacct -D keeps the preempted allocation beside the one that finished
    charged = result.attempts
    assert [a["outcome"] for a in charged] == ["preempted"] * (len(held) - 1) + ["completed"], charged
    assert [a["held_s"] for a in charged] == [float(r["time"]["elapsed"]) for r in held]
    assert {a["slots"] for a in charged} == {2}  # the allocated gres/gpu of one node
    price = POOLS["pools"][POOL]["price_per_gpu_hour"]
    expected = sum(r["time"]["elapsed"] for r in held) * 2 / 3600 * price
    assert result.cost_usd == pytest.approx(expected) == pytest.approx(sum(a["usd"] for a in charged))
    assert charged[0]["usd"] > 0 and result.cost_usd > charged[-1]["usd"]  # the first allocation is paid for too
    assert stage_usd(Path(victim.stage_dir)) == pytest.approx(result.cost_usd)  # what watch adds up


def test_an_sbatch_refusal_is_one_line_and_nothing_is_left_in_the_queue(slurm, tmp_path):
    job = _job(tmp_path / "state", "refused", _tree(nodes=1, priority="nosuch"))
    t, box, log = _start(job)
    t.join(60)
    result = box["result"]
    assert result.status == Status.FAILED
    assert "Invalid qos specification" in result.error and "QOS 'nosuch' (resources.priority)" in result.error
    assert "\n" not in result.error
    assert not [q for q in tslurm.queued_jobs(subprocess.run(["squeue", "--json"], capture_output=True,
                                                             text=True).stdout) if q.name == "tg-refused-full"]


def test_an_admins_scancel_ends_the_stage_cancelled_not_failed_and_not_resubmitted(slurm, tmp_path):
    job = _job(tmp_path / "state", "scancelled", _tree(nodes=1, steps=200), "slow@0")
    t, box, log = _start(job)
    jid = _slurm_id(job)
    _wait(lambda: _step(job) >= 5, "training", log=log)
    subprocess.run(["scancel", jid], check=True)
    t.join(120)
    result = box["result"]
    assert result.status == Status.PREEMPTED, log.text()
    assert "cancelled by scancel outside traingate" in result.error
    assert result.metrics["slurm_resubmits"] == 0 and len(json.loads(
        (Path(job.stage_dir) / tslurm.RECORD_FILE).read_text())["jobs"]) == 1
    assert _sacct(jid).state == "CANCELLED"
    out = next(Path(job.stage_dir).glob("slurm-*.out")).read_text()
    assert "signalled, not preempted (scancel or the time limit)" in out, out[-2000:]


def test_the_stage_is_followed_through_a_controller_restart_to_its_end(slurm, tmp_path):
    job = _job(tmp_path / "state", "restart", _tree(nodes=1, steps=100), "slow@0")
    t, box, log = _start(job)
    _wait(lambda: _step(job) >= 5, "training", log=log)
    # Down for longer than a client waits (~MessageTimeout), then back on its saved state.
    slurm.stop_controller()
    # squeue --json against it exits 0 after ~MessageTimeout, the failure only in its JSON's errors.
    failed = subprocess.run(["squeue", "--json"], capture_output=True, text=True)
    with pytest.raises(tslurm.Unreachable):
        tslurm.queued_jobs(failed.stdout)
    time.sleep(3)
    slurm.start_controller()
    t.join(300)
    result = box["result"]
    assert result.status == Status.COMPLETED and result.metrics["steps"] == 100, log.text()
    assert result.metrics["slurm_resubmits"] == 0
    assert "Slurm controller unreachable" in log.text() and "Slurm controller answers again" in log.text(), log.text()


def test_a_node_is_drained_with_a_traingate_reason_and_returned(slurm, tmp_path, capsys):
    from flows.cli import main

    def cli(*args: str) -> subprocess.CompletedProcess:
        """`traingate pools ARGS` in this process (a `traingate` process each would pay its imports again)."""
        capsys.readouterr()
        code = main(["pools", *args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["traingate", "pools", *args], code, out, err)

    drained = cli("drain", "n2", "--reason", "gpu-ecc")
    assert drained.returncode == 0 and drained.stdout.strip() == "node n2: drained (traingate:gpu-ecc)", drained
    view = {v.name: v for v in tslurm.nodes(subprocess.run(["sinfo", "--json"], capture_output=True,
                                                           text=True).stdout)}
    assert (view["n2"].state, view["n2"].reason) == ("drained", "traingate:gpu-ecc")
    (tmp_path / "pools.yaml").write_text(yaml.safe_dump(POOLS))
    shown = cli("show", str(tmp_path / "pools.yaml"))
    assert shown.returncode == 0 and f"pool {POOL} (Slurm partition gpu): 2 node(s), 1 usable" in shown.stdout, shown
    assert "drained" in shown.stdout and "reason: traingate:gpu-ecc" in shown.stdout
    back = cli("resume", "n2")
    assert back.returncode == 0 and back.stdout.strip() == "node n2: idle", back
    bad = cli("drain", "n9", "--reason", "x")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "'n9' is not a node" in bad.stderr


def test_a_stage_whose_node_is_lost_is_requeued_by_slurm_and_resumes_from_its_checkpoint(slurm, tmp_path):
    # 80 paced steps (0.1 s each): 5.5 s of training left when the node is killed at step 25.
    job = _job(tmp_path / "state", "nodelost", _tree(nodes=1, steps=80), "slow@0")
    t, box, log = _start(job)
    jid = _slurm_id(job)
    _wait(lambda: _step(job) >= 25, "the stage past its step-20 checkpoint", log=log)
    node = _squeue(jid).nodes
    slurm.kill_node(node, jobs=True)  # the machine is gone: its slurmd and everything the job ran there
    t.join(400)
    result = box["result"]
    assert result.status == Status.COMPLETED and result.metrics["steps"] == 80, log.text()
    assert result.metrics["slurm_requeues"] >= 1 and result.metrics["resumed_from_step"] >= 20, result.metrics
    assert _sacct(jid).nodes != node  # Slurm placed the requeued job on the node still up


def test_under_preempt_mode_cancel_a_preempted_stage_comes_back_from_its_checkpoint_bitwise_equal(
        slurm, unpreempted, tmp_path):
    from traingate.supervision.drill import _weights, compare_states, final_state

    slurm.set_preempt_mode("CANCEL")
    job = _job(tmp_path / "state", "cancelmode", _tree(nodes=1, steps=60), "slow@0")
    t, box, log = _start(job)
    jid = _slurm_id(job)
    _wait(lambda: (q := _squeue(jid)) is not None and q.state == "RUNNING", "the victim running", log=log)
    unpreempted.start()  # the undisturbed twin, on the other node meanwhile (if no earlier test ran it)
    _wait(lambda: _step(job) >= 15, "the victim at step 15", log=log)
    urgent = subprocess.run(["sbatch", "--parsable", "--account=vision", "--qos=urgent",
                             f"--nodelist={_squeue(jid).nodes}", "--gres=gpu:a100:2", "--time=2",
                             f"--output={tmp_path}/urgent-%j.out", "--wrap", "sleep 2"], capture_output=True, text=True)
    assert urgent.returncode == 0, urgent.stderr
    t.join(400)
    result = box["result"]
    assert result.status == Status.COMPLETED and result.metrics["steps"] == 60, log.text()
    assert result.metrics["resumed_from_step"] >= 15, result.metrics  # its emergency checkpoint, not step 10
    # Killed without requeue: traingate submitted it again (or the batch step's own requeue brought it back).
    assert result.metrics["slurm_resubmits"] + result.metrics["slurm_requeues"] >= 1, log.text()
    assert compare_states(unpreempted.weights(), _weights(final_state(job.checkpoint_uri))) == []
    print(f"\nPreemptMode=CANCEL: Slurm state of the victim {_sacct(jid).state}; "
          f"resubmits {result.metrics['slurm_resubmits']}, requeues {result.metrics['slurm_requeues']}")


def test_a_straggler_alert_on_a_slurm_pool_drains_its_node_and_pauses_the_stage(slurm, tmp_path):
    tree = _tree(nodes=1, steps=200)
    tree["alerts"] = {"straggler": {"window": 20}}
    job = _job(tmp_path / "state", "straggler", tree, "slow@0:1")  # rank 1 sleeps before every step
    t, box, log = _start(job)
    jid = _slurm_id(job)
    _wait(lambda: (q := _squeue(jid)) is not None and q.state == "RUNNING", "the stage running", log=log)
    node = _squeue(jid).nodes
    t.join(300)
    result = box["result"]
    assert result.status == Status.PREEMPTED and "paused by alert straggler" in result.error, log.text()
    assert result.metrics["slurm_resubmits"] == 0  # a pause is not a preemption: nothing submitted again
    view = {v.name: v for v in tslurm.nodes(subprocess.run(["sinfo", "--json"], capture_output=True,
                                                           text=True).stdout)}
    assert view[node].state in ("drained", "draining") and view[node].reason == "traingate:straggler", view[node]
    alert = json.loads((Path(job.stage_dir) / "alerts.jsonl").read_text().splitlines()[0])
    assert f"Slurm node {node} drained (reason traingate:straggler)" in alert["outcome"], alert
