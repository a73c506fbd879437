"""The Slurm engine's overhead, on the real Slurm 22.05 test cluster (tests/slurm/cluster.py: two nodes of two
fake a100 GPUs each, started here and torn down at the end; needs root and the Debian Slurm packages).

(a) idle pool: submit -> Slurm starts the job (Slurm's own scheduling) and Slurm's start -> the first training
    step (what traingate adds: batch step, supervisor, torchrun, imports, rendezvous), beside the local engine's
    launch -> first step of the same stage;
(b) an urgent stage submitted while a research victim holds all four GPUs: submit -> the urgent's first step
    (Slurm preempts the victim, whose emergency checkpoint, requeue and exit free the GPUs), beside (a)'s;
(c) the tiny digits ladder (unit -> smoke -> canary -> full) on the Slurm pool vs the same ladder on the local
    engine, same invocation, same Prefect server.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test cluster and the tiny digits spec are the tests' own

from slurm.cluster import SlurmCluster, missing_binaries  # noqa: E402
from tgtest import TINY_DIGITS  # noqa: E402

POOL = "slurm-gpu"
POOLS = {
    "pools": {
        POOL: {
            "gpu": "A100-80GB",
            "gpus_per_node": 2,
            "nodes": 2,
            "price_per_gpu_hour": 1.0,
            "worker": "process",
            "engine": "slurm",
            "slurm": {"partition": "gpu", "gres_type": "a100"},
        }
    }
}


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args if args else msg)

    warning = error = info


def _tree(nodes: int = 1, steps: int = 16, priority: str = "research") -> dict[str, Any]:
    tree = yaml.safe_load(TINY_DIGITS)
    tree["identity"]["team"] = "vision"
    tree["resources"] = {
        "work_pool": POOL,
        "nodes": nodes,
        "procs_per_node": 2,
        "priority": priority,
        **({"rdzv_endpoint": "n1:29512"} if nodes > 1 else {}),
    }
    tree["pools"] = {POOL: {"price_per_gpu_hour": 1.0, "gpus_per_node": 2}}
    tree["stages"]["full"] = {"max_steps": steps}
    tree["checkpoint"] = {"every_steps": 10}
    return tree


def _job(state: Path, run_id: str, tree: dict[str, Any], faults: str | None = None) -> Any:
    from traingate.job.stagejob import derive
    from traingate.settings import Settings
    from traingate.spec import parse_spec

    tree = {**tree, "tracking": {"enabled": False}}
    return derive(
        parse_spec(tree),
        "full",
        run_id=run_id,
        run_dir=state / "runs" / run_id,
        settings=Settings.from_env({"TRAINGATE_STATE_DIR": str(state)}),
        faults=faults,
    )


def _start(job: Any, stop: threading.Event) -> tuple[threading.Thread, dict[str, Any]]:
    from tasks.slurm import run_on_slurm
    from traingate.capacity.pools import parse_config

    pool = parse_config(POOLS).pools[POOL]
    box: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: box.update(
            result=run_on_slurm(job, pool, False, lambda: "bench done" if stop.is_set() else None, _Log())
        ),
        daemon=True,
    )
    t.start()
    return t, box


def _wait(cond: Any, what: str, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _record(job: Any) -> dict[str, Any]:
    p = Path(job.stage_dir) / "slurm.json"
    return json.loads(p.read_text()) if p.exists() else {"jobs": []}


def _first_step(job: Any) -> float | None:
    p = Path(job.stage_dir) / "supervisor.json"
    try:
        attempts = json.loads(p.read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return None
    return next((a["first_step_time"] for a in attempts if a.get("first_step_time")), None)


def _step(job: Any) -> int:
    try:
        return int(json.loads((Path(job.stage_dir) / "heartbeat.rank0.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def _sacct_start(jid: str) -> int:
    from traingate.capacity import slurm, slurm_cli

    a = slurm.accounted_job(slurm_cli.sacct(jid), jid)
    assert a is not None and a.start, f"sacct has no start for job {jid}"
    return a.start


def _launched(job: Any) -> float:
    """When the batch step's supervisor started torchrun (its first attempt)."""
    return float(json.loads((Path(job.stage_dir) / "supervisor.json").read_text())["attempts"][0]["launched_at"])


def _batch_python(job: Any) -> tuple[float, float] | None:
    """(the batch step's python start, its imports done), as the batch step printed them."""
    out = "".join(p.read_text() for p in Path(job.stage_dir).glob("slurm-*.out"))
    m = re.search(r"python started at ([0-9.]+) \(epoch s\), ready ([0-9.]+) s later", out)
    return (float(m.group(1)), float(m.group(1)) + float(m.group(2))) if m else None


def _idle(state: Path) -> dict[str, float]:
    """One stage on the idle pool, as a timeline from its sbatch (seconds since the submit)."""
    job = _job(state, f"idle-{time.monotonic_ns()}", _tree())
    stop = threading.Event()
    t, box = _start(job, stop)
    t.join(400)
    assert box["result"].status == "completed", box["result"].error
    rec = _record(job)["jobs"][-1]
    start, first = _sacct_start(rec["id"]), _first_step(job)
    assert first is not None
    sub = rec["submitted"]
    times = {"slurm_start": start - sub, "torchrun": _launched(job) - sub, "first_step": first - sub}
    py = _batch_python(job)
    if py is not None:
        times["python"], times["imports"] = py[0] - sub, py[1] - sub
    return times


def _urgent(state: Path) -> tuple[float, float, float]:
    """(submit -> first step of an urgent stage while a victim holds all GPUs, submit -> its Slurm start,
    victim's step when preempted)."""
    victim = _job(state, f"victim-{time.monotonic_ns()}", _tree(nodes=2, steps=200), "slow@0")
    stop = threading.Event()
    tv, _ = _start(victim, stop)
    _wait(lambda: _step(victim) >= 5, "the victim training on both nodes")
    urgent = _job(state, f"urgent-{time.monotonic_ns()}", _tree(priority="urgent"))
    tu, bu = _start(urgent, threading.Event())
    tu.join(400)
    stop.set()  # the victim's requeued job is stopped at a checkpoint: it is not measured
    tv.join(400)
    assert bu["result"].status == "completed", bu["result"].error
    first = _first_step(urgent)
    assert first is not None
    rec = _record(urgent)["jobs"][0]
    return first - rec["submitted"], _sacct_start(rec["id"]) - rec["submitted"], float(_step(victim))


def _ladder(spec: Path) -> float:
    from flows.pipeline import pipeline

    t0 = time.perf_counter()
    state = pipeline(str(spec), [], "full", return_state=True)
    wall = time.perf_counter() - t0
    assert state.is_completed(), state.message
    return wall


def _local_launch_to_first_step(state_dir: Path) -> float:
    """The local ladder's full stage: launch -> first training step (the same process tree, no Slurm)."""
    runs = sorted((state_dir / "runs").iterdir(), key=lambda d: d.stat().st_mtime)
    sup = json.loads((runs[-1] / "full" / "supervisor.json").read_text())
    a = sup["attempts"][0]
    return float(a["first_step_time"] - a["launched_at"])


def _timeline(t: dict[str, float]) -> list[str]:
    """Where (a)'s seconds go, each row the time since the previous mark (sacct's start: whole seconds)."""
    marks = [
        ("slurm_start", "submit -> Slurm's start of the job (Slurm's scheduling; sacct, 1 s resolution)"),
        ("python", "-> the batch step's python started (slurmd's prolog and job launch: Slurm's)"),
        ("imports", "-> its imports done (traingate)"),
        ("torchrun", "-> torchrun started by the supervisor (traingate: job file, stage set-up)"),
        ("first_step", "-> first training step (torchrun, ranks' imports, rendezvous, build: as on the local engine)"),
    ]
    rows, prev = [], 0.0
    for key, what in marks:
        if key in t:
            rows.append(f"| (a) timeline: {what} | {t[key] - prev:.2f} |")
            prev = t[key]
    return rows


def main() -> str:
    missing = missing_binaries()
    if missing or os.geteuid() != 0:
        return f"bench slurm: not run: {missing[0] + ' is not installed' if missing else 'needs root'}"
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-slurm-"))
    os.chmod(tmp, 0o755)  # the cluster's job users traverse it
    state_dir = tmp / "state"
    os.environ["TRAINGATE_STATE_DIR"] = str(state_dir)
    os.environ.setdefault("PREFECT_HOME", str(tmp / "prefect"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
    from prefect import get_client
    from prefect.testing.utilities import prefect_test_harness

    from tasks import slots
    from traingate.capacity.pools import parse_config

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    cluster = SlurmCluster.start(tmp / "cluster")
    cluster_s = time.perf_counter() - t0
    try:
        os.environ.update(cluster.env)
        idle = _idle(tmp / "direct")
        sched, added = idle["slurm_start"], idle["first_step"] - idle["slurm_start"]
        urgent_s, urgent_start, victim_step = _urgent(tmp / "direct")
        spec = tmp / "spec.yaml"
        spec.write_text(yaml.safe_dump(_tree()))
        with prefect_test_harness(server_startup_timeout=180):
            local_s = _ladder(spec)  # no capacity config on the server: the local engine runs the pool
            local_first = _local_launch_to_first_step(state_dir)
            with get_client(sync_client=True) as c:
                slots.put_variable(c, slots.CONFIG_VAR, parse_config(POOLS).model_dump(mode="json"))
            slurm_s = _ladder(spec)
    finally:
        cluster.stop()
    load1 = os.getloadavg()
    cpus = os.cpu_count()
    return "\n".join(
        [
            f"Slurm 22.05 test cluster (2 nodes x 2 fake a100, started in {cluster_s:.1f} s) on this host "
            f"({cpus} CPUs; load average {load0[0]:.1f} before, {load1[0]:.1f} after). One stage = the tiny "
            "digits `full` stage (16 steps, 1 node x 2 processes).",
            "",
            "| measure | seconds |",
            "|---|---|",
            f"| (a) idle pool: submit -> Slurm starts the job (Slurm's scheduling) | {sched:.1f} |",
            f"| (a) idle pool: Slurm's start -> first training step (traingate's batch step) | {added:.1f} |",
            *_timeline(idle),
            f"| (a) local engine, same stage: launch -> first training step | {local_first:.1f} |",
            f"| (b) urgent submit -> urgent first step, victim on all 4 GPUs (victim at step {victim_step:.0f}) "
            f"| {urgent_s:.1f} |",
            f"| (b) of which urgent submit -> its Slurm start (victim signalled, checkpointed, requeued, gone) "
            f"| {urgent_start:.1f} |",
            f"| (c) tiny digits ladder on the local engine | {local_s:.1f} |",
            f"| (c) the same ladder on the Slurm pool | {slurm_s:.1f} |",
            "",
            f"traingate's added latency on Slurm (Slurm start -> first step) / the local engine's launch -> first "
            f"step = **{added / local_first:.2f}x**; urgent under contention / idle submit -> first step = "
            f"**{urgent_s / (sched + added):.2f}x**; ladder Slurm / local = **{slurm_s / local_s:.2f}x**",
        ]
    )


if __name__ == "__main__":
    print(main())
