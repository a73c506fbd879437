"""The Slurm engine's overhead, on the real Slurm 22.05 test cluster (tests/slurm/cluster.py: two nodes of two
fake a100 GPUs each, started here and torn down at the end; needs root and the Debian Slurm packages).

(a) idle pool: traingate's added latency. The tiny digits ``full`` stage submitted by traingate, and the same
    training as a user's own batch job (``srun torchrun ... bench/bare_digits.py``: the recipe's model, data and
    loss, DDP, no traingate), alternating, ``TRAINGATE_BENCH_SLURM_PAIRS`` pairs (default 3); each a timeline
    from its sbatch to its first training step. Added latency = traingate's submit -> first step minus the bare
    job's, pair by pair; Slurm's own scheduling is in both;
(b) an urgent stage submitted while a research victim holds all four GPUs: the grace (urgent submit -> its Slurm
    start: the victim's emergency checkpoint, requeue and exit) and the rest up to its first step;
(c) the tiny digits ladder (unit -> smoke -> canary -> full) on the Slurm pool vs the same ladder on the local
    engine, same invocation, same Prefect server.

``TRAINGATE_BENCH_SLURM_PARTS`` (default ``idle,urgent,ladder``) runs a subset; ``bare`` is one bare job's start
alone. ``TRAINGATE_BENCH_SLURM_WARM=1`` gives traingate's stages in (a) ``supervision.warm_restarts: true`` (as
``examples/digits.yaml`` has it): a zygote imports torch, TorchDynamo and the trainer once and forks the ranks.
(b)'s urgent stage runs once per variant in ``TRAINGATE_BENCH_SLURM_URGENT`` (default ``warm`` with
``TRAINGATE_BENCH_SLURM_WARM=1``, else ``cold``), ``TRAINGATE_BENCH_SLURM_ROUNDS`` times (default 1; the order
reversed every other round): ``cold`` (the default spec), ``warm`` (warm restarts; the zygote starts ahead of the
batch step, as traingate submits it), ``late`` (warm restarts, the zygote started by the supervisor after the batch
step's imports: the comparison for ``warm``); ``base:VARIANT`` runs VARIANT with the checkout at
``TRAINGATE_BENCH_SLURM_BASELINE`` on the job's ``PYTHONPATH`` (its batch step, zygote, agent and ranks run that
code: a change of theirs against the code before it, alternated in one invocation).

Quick mode, (b) only: ``TRAINGATE_BENCH_SLURM_PARTS=quick python -m bench slurm`` is one bare job and the urgent
stage cold and warm, in one invocation (about 3 minutes on an idle 2-core box).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
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


def _tree(nodes: int = 1, steps: int = 16, priority: str = "research", warm: bool | None = None) -> dict[str, Any]:
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
    if WARM if warm is None else warm:
        tree["supervision"] = {"warm_restarts": True}
    return tree


def _job(state: Path, run_id: str, tree: dict[str, Any], faults: str | None = None, tracked: bool = True) -> Any:
    """The stage's StageJob; ``tracked``: tracked in an MLflow run of its own in the state dir's store, as a
    ladder's stage is (its supervisor delivers the rank's journal to it)."""
    from traingate.job.stagejob import derive
    from traingate.settings import Settings
    from traingate.spec import parse_spec
    from traingate.tracking import runs

    settings = Settings.from_env({"TRAINGATE_STATE_DIR": str(state)})
    mlflow_run_id = None
    if tracked:
        client = runs.client(settings.tracking_uri)
        exp = client.get_experiment_by_name("bench-slurm")
        exp_id = exp.experiment_id if exp is not None else client.create_experiment("bench-slurm")
        mlflow_run_id = client.create_run(exp_id, run_name=run_id).info.run_id
    else:
        tree = {**tree, "tracking": {"enabled": False}}
    return derive(
        parse_spec(tree),
        "full",
        run_id=run_id,
        run_dir=state / "runs" / run_id,
        settings=settings,
        mlflow_run_id=mlflow_run_id,
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


def _rank_timeline(job: Any) -> dict[str, float]:
    """Rank 0's own marks of its first attempt (epoch s): python started, imports done, process group formed,
    checkpoint/tracking/recipe set up."""
    try:
        return dict(json.loads((Path(job.stage_dir) / "heartbeat.rank0.json").read_text())["timeline"])
    except (OSError, ValueError, KeyError):
        return {}


def _times(job: Any, rec: dict[str, Any]) -> dict[str, float]:
    """The stage's first allocation as a timeline from its sbatch (seconds since the submit)."""
    start, first = _sacct_start(rec["id"]), _first_step(job)
    assert first is not None
    sub = rec["submitted"]
    times = {"slurm_start": start - sub, "torchrun": _launched(job) - sub, "first_step": first - sub}
    py = _batch_python(job)
    if py is not None:
        times["python"], times["imports"] = py[0] - sub, py[1] - sub
    rank = _rank_timeline(job)
    for key, mark in (("process_start", "rank_python"), ("imported", "rank_imports"), ("rendezvous", "rendezvous")):
        if key in rank:
            times[mark] = rank[key] - sub
    if "loaded" in rank:
        times["set_up"] = rank["loaded"] - sub
    return times


def _idle(state: Path) -> dict[str, float]:
    """One stage on the idle pool."""
    job = _job(state, f"idle-{time.monotonic_ns()}", _tree())
    stop = threading.Event()
    t, box = _start(job, stop)
    t.join(400)
    assert box["result"].status == "completed", box["result"].error
    _delivered(job)
    return _times(job, _record(job)["jobs"][-1])


def _delivered(job: Any) -> None:
    """A tracked stage's metrics reached its MLflow run (the supervisor delivered the rank's journal)."""
    from traingate.settings import Settings
    from traingate.tracking import runs

    if job.mlflow_run_id is None:
        return
    client = runs.client(Settings.from_env({"TRAINGATE_STATE_DIR": str(Path(job.run_dir).parents[1])}).tracking_uri)
    metrics = client.get_run(job.mlflow_run_id).data.metrics
    assert "train_loss" in metrics, f"stage {job.run_id}: no train_loss in its MLflow run ({sorted(metrics)})"


def _bare(state: Path, steps: int = 16) -> dict[str, float]:
    """The same training as a user's own batch job: ``srun torchrun ... bench/bare_digits.py`` on one node of the
    same partition, account and QOS, no traingate around it; the same timeline from its sbatch."""
    from traingate.capacity import slurm, slurm_cli

    out_dir = state / f"bare-{time.monotonic_ns()}"
    out_dir.mkdir(parents=True)
    marks = out_dir / "marks.json"
    tr = _tree()
    run = shlex.join(
        [
            "srun",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={tr['resources']['procs_per_node']}",
            str(ROOT / "bench" / "bare_digits.py"),
            str(marks),
            str(steps),
        ]
    )
    cmd = [
        "sbatch",
        "--parsable",
        "--partition=gpu",
        "--nodes=1",
        "--ntasks-per-node=1",
        f"--gres=gpu:a100:{tr['resources']['procs_per_node']}",
        f"--account={tr['identity']['team']}",
        f"--qos={tr['resources']['priority']}",
        "--time=10",
        f"--output={out_dir / 'slurm-%j.out'}",
        f"--chdir={out_dir}",
        f"--wrap={run}",
    ]
    jid = slurm.parse_job_id(slurm_cli.run(cmd))
    sub = time.time()

    def ended() -> bool:
        q = slurm.queued_job(slurm_cli.squeue(), jid)
        return q is None or slurm.ending(q.state) is not None

    _wait(ended, f"bare job {jid} to end", 400)
    assert marks.exists(), "".join(p.read_text() for p in out_dir.glob("slurm-*.out"))
    m = json.loads(marks.read_text())
    times = {"slurm_start": _sacct_start(jid) - sub, "rank_python": m["python"] - sub}
    times.update(rank_imports=m["imports"] - sub, rendezvous=m["rendezvous"] - sub, first_step=m["first_step"] - sub)
    return times


def _urgent(state: Path, variant: str) -> dict[str, float]:
    """An urgent stage submitted while a victim holds all GPUs: its timeline, and the victim's step when
    preempted. ``variant``: cold, warm (the zygote started ahead of the batch step) or late (warm, the zygote
    started by the supervisor)."""
    victim = _job(state, f"victim-{time.monotonic_ns()}", _tree(nodes=2, steps=200), "slow@0", tracked=False)
    stop = threading.Event()
    tv, _ = _start(victim, stop)
    _wait(lambda: _step(victim) >= 5, "the victim training on both nodes")
    baseline = variant.startswith("base:")
    variant = variant.removeprefix("base:")
    urgent = _job(state, f"urgent-{time.monotonic_ns()}", _tree(priority="urgent", warm=variant != "cold"))
    if variant == "late":
        LATE.add(urgent.run_id)
    load = os.getloadavg()[0]
    if baseline:
        os.environ["PYTHONPATH"] = BASELINE  # sbatch exports the submitter's environment to the job
    tu, bu = _start(urgent, threading.Event())
    if baseline:
        _wait(lambda: bool(_record(urgent)["jobs"]), "the urgent job's submission")
        del os.environ["PYTHONPATH"]
    tu.join(400)
    stop.set()  # the victim's requeued job is stopped at a checkpoint: it is not measured
    tv.join(400)
    assert bu["result"].status == "completed", bu["result"].error
    _delivered(urgent)
    times = _times(urgent, _record(urgent)["jobs"][0])
    times["load"] = load
    zlog = Path(urgent.stage_dir) / "zygote.log"
    ready = re.search(
        r"zygote: ready on \S+ \(pid \d+\) at ([0-9.]+)(?:, imports [0-9.]+ s, ([0-9.]+) CPU-s)?",
        zlog.read_text() if zlog.exists() else "",
    )
    if ready:
        times["zygote_ready"] = float(ready.group(1)) - _record(urgent)["jobs"][0]["submitted"]
        if ready.group(2):
            times["zygote_cpu"] = float(ready.group(2))
    out = "".join(p.read_text() for p in Path(victim.stage_dir).glob("slurm-*.out"))
    m = re.search(r"signalled at ([0-9.]+), tree stopped at ([0-9.]+).*\n(?:.*requeued job \S+ at ([0-9.]+))?", out)
    assert m, f"the victim {victim.run_id} was not preempted (did it end before the urgent job came?): {out[-2000:]}"
    if m:
        sub = _record(urgent)["jobs"][0]["submitted"]
        times.update(victim_signalled=float(m.group(1)) - sub, victim_stopped=float(m.group(2)) - sub)
        if m.group(3):
            times["victim_requeued"] = float(m.group(3)) - sub
    return times


VICTIM_MARKS = [
    ("victim_signalled", "of which urgent submit -> the victim's batch step signalled (Slurm's preemption)"),
    ("victim_stopped", "-> its supervision ended (emergency checkpoint, every process of the tree gone)"),
    ("victim_requeued", "-> `scontrol requeue` done (Slurm's REQUEUE mode had not requeued it itself)"),
    ("slurm_start", "-> the urgent job started (the batch step's exit, the job's end, Slurm)"),
]


def _victim_cells(u: dict[str, float]) -> dict[str, float]:
    """The grace, mark by mark, as the victim's batch step printed them: {row label: seconds}."""
    cells, prev = {}, 0.0
    for key, what in VICTIM_MARKS:
        if key in u and "victim_signalled" in u:
            cells[what] = u[key] - prev
            prev = u[key]
    return cells


def _urgent_rows(runs: list[tuple[str, dict[str, float]]], bare: list[dict[str, float]]) -> list[str]:
    """(b): one column per urgent run, its grace and its rest segment by segment; the bare job's start below."""
    head = [f"run {i + 1}: {variant}" for i, (variant, _) in enumerate(runs)]
    rows = (
        [f"| (b) urgent stage while a research victim holds all 4 GPUs (s) | {' | '.join(head)} |"]
        + ["|---" * (len(runs) + 1) + "|"]
        if runs
        else []
    )

    def row(what: str, cells: list[float | None], bold: bool = False) -> None:
        if not cells:
            return
        text = " | ".join("-" if c is None else (f"**{c:.2f}**" if bold else f"{c:.2f}") for c in cells)
        rows.append(f"| {f'**{what}**' if bold else what} | {text} |")

    row("load average at the urgent submit", [u["load"] for _, u in runs])
    row("grace: urgent submit -> its Slurm start (sacct, whole seconds)", [u["slurm_start"] for _, u in runs], True)
    victim = [_victim_cells(u) for _, u in runs]
    for _, what in VICTIM_MARKS:
        if any(what in v for v in victim):
            row(what, [v.get(what) for v in victim])
    segs = [_segments(u) for _, u in runs]
    for key, what in MARKS[1:]:
        if any(key in sg for sg in segs):
            row(what, [sg.get(key) for sg in segs])
    row(
        "(warm) the zygote's imports done, s after the urgent job's Slurm start",
        [u["zygote_ready"] - u["slurm_start"] if "zygote_ready" in u else None for _, u in runs],
    )
    row("(warm) the zygote's CPU-s from its start to its imports done", [u.get("zygote_cpu") for _, u in runs])
    row("urgent submit -> urgent first step", [u["first_step"] for _, u in runs], True)
    row("the rest (first step - grace; goal <= 5 s)", [u["first_step"] - u["slurm_start"] for _, u in runs], True)
    if bare:
        starts = [b["first_step"] - b["slurm_start"] for b in bare]
        rows += [
            "",
            f"Bare `srun torchrun` job on the idle pool, same invocation ({len(bare)} run(s), median): its Slurm "
            f"start -> first step {_med(starts)} s (submit -> first step {_med([b['first_step'] for b in bare])} s).",
        ]
    return rows


def _ladder(spec: Path) -> float:
    from flows.pipeline import pipeline

    t0 = time.perf_counter()
    state = pipeline(str(spec), [], "full", return_state=True)
    wall = time.perf_counter() - t0
    assert state.is_completed(), state.message
    return wall


PAIRS = int(os.environ.get("TRAINGATE_BENCH_SLURM_PAIRS", "3"))
WARM = os.environ.get("TRAINGATE_BENCH_SLURM_WARM") == "1"
PARTS = os.environ.get("TRAINGATE_BENCH_SLURM_PARTS", "idle,urgent,ladder").split(",")
QUICK = PARTS == ["quick"]
if QUICK:
    PARTS = ["bare", "urgent"]
URGENT = os.environ.get("TRAINGATE_BENCH_SLURM_URGENT", "cold,warm" if QUICK else "warm" if WARM else "cold").split(",")
ROUNDS = int(os.environ.get("TRAINGATE_BENCH_SLURM_ROUNDS", "1"))
BASELINE = os.environ.get("TRAINGATE_BENCH_SLURM_BASELINE", "")
if any(v.startswith("base:") for v in URGENT) and not Path(BASELINE, "traingate").is_dir():
    raise SystemExit(
        f"TRAINGATE_BENCH_SLURM_BASELINE={BASELINE!r}: a base: variant needs a checkout of traingate there"
    )
LATE: set[str] = set()  # run ids whose zygote the supervisor starts (variant "late"), not ahead of the batch step


def _sbatch_late_zygotes() -> None:
    """Submissions of the run ids in LATE leave their zygote to the supervisor, as a batch step without
    ``--zygote`` does (the comparison for the zygote started ahead)."""
    from tasks import slurm as tslurm

    submit = tslurm.slurm.sbatch_command

    def sbatch(job: Any, pool: Any, **kw: Any) -> list[str]:
        return submit(job, pool, **{**kw, "zygote_log": None}) if job.run_id in LATE else submit(job, pool, **kw)

    tslurm.slurm.sbatch_command = sbatch  # type: ignore[assignment]


# (a)'s marks, seconds since the sbatch returned; a segment runs from the mark before it.
MARKS = [
    ("slurm_start", "submit -> Slurm's start of the job (Slurm's scheduling; sacct, 1 s resolution)"),
    ("python", "-> traingate's batch step: python started (slurmd's job launch)"),
    ("imports", "-> its imports done"),
    ("torchrun", "-> torchrun started by the supervisor (job file, stage set-up)"),
    ("rank_python", "-> rank 0's python started (torchrun's agent; bare: srun + the agent)"),
    ("rank_imports", "-> rank 0's imports done (torch, the recipe; traingate: its runtime)"),
    ("rendezvous", "-> process group formed"),
    ("set_up", "-> traingate's set-up done (recipe, data, model, checkpoint look-up, tracking)"),
    ("first_step", "-> first training step done"),
]


def _segments(t: dict[str, float]) -> dict[str, float]:
    """Each mark's time since the mark before it (marks a run lacks are skipped)."""
    out, prev = {}, 0.0
    for key, _ in MARKS:
        if key in t:
            out[key] = t[key] - prev
            prev = t[key]
    return out


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def _added_rows(pairs: list[tuple[dict[str, float], dict[str, float]]]) -> list[str]:
    """(a): traingate's and the bare job's timelines, segment by segment (medians of the pairs), and per pair."""
    tg = [_segments(t) for t, _ in pairs]
    bare = [_segments(b) for _, b in pairs]
    rows = [
        "| (a) idle pool, median of the pairs (s) | traingate | bare `srun torchrun` | traingate - bare |",
        "|---|---|---|---|",
    ]
    for key, what in MARKS:
        a, b = [s[key] for s in tg if key in s], [s[key] for s in bare if key in s]
        diff = f"{statistics.median(a) - statistics.median(b):+.2f}" if a and b else "-"
        rows.append(f"| {what} | {_med(a)} | {_med(b)} | {diff} |")
    added = [t["first_step"] - b["first_step"] for t, b in pairs]
    rows.append(
        f"| **submit -> first training step** | **{_med([t['first_step'] for t, _ in pairs])}** | "
        f"**{_med([b['first_step'] for _, b in pairs])}** | **{_med(added)}** |"
    )
    rows += [
        "",
        "| pair | traingate submit -> first step | bare submit -> first step | traingate's added latency |",
        "|---|---|---|---|",
        *(
            f"| {i + 1} | {t['first_step']:.2f} | {b['first_step']:.2f} | {t['first_step'] - b['first_step']:+.2f} |"
            for i, (t, b) in enumerate(pairs)
        ),
    ]
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
    rows: list[str] = []
    try:
        os.environ.update(cluster.env)
        pairs: list[tuple[dict[str, float], dict[str, float]]] = []
        for i in range(PAIRS if "idle" in PARTS else 0):  # alternating which goes first
            if i % 2 == 0:
                tg = _idle(tmp / "direct")
                pairs.append((tg, _bare(tmp / "bare")))
            else:
                bare = _bare(tmp / "bare")
                pairs.append((_idle(tmp / "direct"), bare))
        if pairs:
            rows += [*_added_rows(pairs), ""]
        bare = [_bare(tmp / "bare")] if "bare" in PARTS else []
        if "urgent" in PARTS:
            _sbatch_late_zygotes()
            order = [URGENT if r % 2 == 0 else URGENT[::-1] for r in range(ROUNDS)]
            urgent = [(v, _urgent(tmp / "direct", v)) for variants in order for v in variants]
            rows += [*_urgent_rows(urgent, bare), ""]
        elif bare:
            rows += [*_urgent_rows([], bare), ""]
        if "ladder" in PARTS:
            spec = tmp / "spec.yaml"
            spec.write_text(yaml.safe_dump(_tree()))
            with prefect_test_harness(server_startup_timeout=180):
                local_s = _ladder(spec)  # no capacity config on the server: the local engine runs the pool
                with get_client(sync_client=True) as c:
                    slots.put_variable(c, slots.CONFIG_VAR, parse_config(POOLS).model_dump(mode="json"))
                slurm_s = _ladder(spec)
            rows += [
                f"(c) tiny digits ladder: local engine {local_s:.1f} s, Slurm pool {slurm_s:.1f} s: "
                f"**{slurm_s / local_s:.2f}x**"
            ]
    finally:
        cluster.stop()
    load1 = os.getloadavg()
    return "\n".join(
        [
            f"Slurm 22.05 test cluster (2 nodes x 2 fake a100, started in {cluster_s:.1f} s) on this host "
            f"({os.cpu_count()} CPUs; load average {load0[0]:.1f} before, {load1[0]:.1f} after). One stage = the "
            f"tiny digits `full` stage (16 steps, 1 node x 2 processes); {len(pairs)} pairs traingate/bare, "
            f"alternating; traingate's warm restarts in (a) {'on' if WARM else 'off'}. Seconds since the `sbatch` "
            "returned.",
            "",
            *rows,
        ]
    )


if __name__ == "__main__":
    print(main())
