"""Trigger to first training step: the ladder deployment on the native production stack's running server and
worker, against `traingate run` with its temporary Prefect server, in the same invocation.

The stack is infra/local-stack.sh (Prefect and MLflow servers on PostgreSQL, S3 on moto, a process worker
per pool), brought up once before the clock starts: it is the long-running service a team triggers from
the UI. Both runs take the demo spec (examples/digits.yaml) to its smoke stage; "first step" is the time of
the smoke stage's first line in metrics.jsonl (rank 0's clock), "run" is until the run's final state.

``TRAINGATE_BENCH_STACK_BASELINE=REF`` (a git ref) adds the stack half on that commit's code: a temporary
worktree of REF brings up its own stack, and the two checkouts alternate ``TRAINGATE_BENCH_STACK_ROUNDS``
times (default 1) in the same invocation, each part reported side by side.

``TRAINGATE_BENCH_STACK_ENGINES=ROUNDS``: the stack half alone, this checkout's stack brought up once (one
untimed run first), its flow runs alternating ROUNDS times between the pool's own command (forked from the
worker's flow-run zygote, flows/warm_engine.py) and Prefect's ``python -m prefect.engine`` given as the
run's ``command`` job variable (a cold process, as a worker starts one by default).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Collection, Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "digits.yaml"
PYTHON = sys.executable
TIMEOUT_S = 900


def _bare_env(**extra: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "TRAINGATE_PYTHON": PYTHON,
        **extra,
    }


def _first_step(state: Path, deadline: float, known: Collection[Path] = ()) -> float:
    from traingate.job import files

    while time.monotonic() < deadline:
        for stage_dir in set(state.glob("runs/*/smoke")) - set(known):
            if metrics := files.read_metrics(stage_dir):
                return metrics[0].time
        time.sleep(0.05)
    raise TimeoutError(f"no smoke step under {state} in {TIMEOUT_S} s")


def _stack(d: Path, action: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [str(root / "infra" / "local-stack.sh"), action],
        env=_bare_env(TRAINGATE_STACK_DIR=str(d)),
        cwd=d.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if p.returncode != 0:
        raise RuntimeError(f"local-stack.sh {action} failed: {p.stdout[-2000:]}{p.stderr[-2000:]}")
    return p


def _on_stack(tmp: Path, root: Path = ROOT) -> tuple[dict[str, float], float]:
    with _running_stack(tmp, root) as (d, state, up_s):
        return _trigger(d, state), up_s


@contextlib.contextmanager
def _running_stack(tmp: Path, root: Path = ROOT) -> Iterator[tuple[Path, Path, float]]:
    """The stack up and ready, in the Prefect settings of its client: (its dir, its state dir, seconds up)."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    d = tmp / "stack"
    if os.geteuid() == 0:  # PostgreSQL runs as the postgres user: the temp dir must be searchable
        tmp.chmod(0o711)
    t0 = time.monotonic()
    _stack(d, "up", root)
    up_s = time.monotonic() - t0
    _wait_ready(d, root)
    # `env`: the client's settings with its credentials (the servers authenticate every client)
    client = dict(
        shlex.split(line.removeprefix("export "))[0].split("=", 1)
        for line in _stack(d, "env", root).stdout.splitlines()
    )
    state = Path(client["TRAINGATE_STATE_DIR"])
    try:
        with temporary_settings(
            updates={
                PREFECT_API_URL: client["PREFECT_API_URL"],
                PREFECT_API_AUTH_STRING: client["PREFECT_API_AUTH_STRING"],
            }
        ):
            yield d, state, up_s
    finally:
        _stack(d, "down", root)


def _trigger(d: Path, state: Path, job_variables: dict[str, str] | None = None) -> dict[str, float]:
    """One ladder flow run to its smoke stage, as the UI's run form starts it: its times and parts."""
    from prefect import get_client
    from prefect.deployments import run_deployment

    load = os.getloadavg()[0]
    known = set(state.glob("runs/*/smoke"))
    start = time.time()
    run = run_deployment(
        "ladder/ladder-cpu",
        timeout=0,
        parameters={"spec": yaml.safe_load(SPEC.read_text()), "until": "smoke"},
        job_variables=job_variables,
    )
    first = _first_step(state, time.monotonic() + TIMEOUT_S, known)
    with get_client(sync_client=True) as c:
        while not (fr := c.read_flow_run(run.id)).state.is_final():
            time.sleep(0.2)
        done = time.time()
        parts = _parts(c, run.id, start, first, state, known)
    if not fr.state.is_completed():
        raise RuntimeError(f"the ladder deployment ended {fr.state.type.value}: {fr.state.message}")
    return {"first": first - start, "run": done - start, **parts, "load average (1 min) at the trigger": load}


def _engines(tmp: Path, rounds: int) -> str:
    """Flow runs forked from the worker's zygote against cold ``python -m prefect.engine``, alternated on one stack."""
    if os.geteuid() == 0:
        tmp.chmod(0o711)
    got: dict[str, list[dict[str, float]]] = {"cold": [], "forked": []}
    cold = {"command": "python -m prefect.engine"}
    with _running_stack(tmp) as (d, state, _):
        _trigger(d, state)  # untimed: the first run creates the experiment, the stores' tables, the caches
        for r in range(rounds):
            for name in ("cold", "forked") if r % 2 == 0 else ("forked", "cold"):
                got[name].append(_trigger(d, state, cold if name == "cold" else None))
        log = (d / "logs" / "worker-cpu-local.log").read_text(errors="replace")
    forked = log.count("flow-run zygote: forked")
    out = ["| part (s) | cold `python -m prefect.engine` | forked from the zygote |", "|---|---|---|"]

    def cell(rows: list[dict[str, float]], k: str) -> str:
        values = [row[k] for row in rows]
        return f"{', '.join(f'{v:.1f}' for v in values)} (mean {sum(values) / len(values):.1f})"

    labels = {"first": "**trigger -> first smoke step**", "run": "trigger -> run Completed, unit + smoke"}
    for k in got["cold"][0]:
        out.append(f"| {labels.get(k, k)} | {cell(got['cold'], k)} | {cell(got['forked'], k)} |")
    out.append(f"\n(flow runs forked by the zygote, the untimed one included: {forked} of {2 * rounds + 1})")
    return "\n".join(out)


def _wait_ready(d: Path, root: Path) -> None:
    """The stack as it runs for a team: its worker polling and, where the compose file wraps the worker
    (flows/warm_engine.py), the flow-run zygote ready. The trigger is not timed against their start."""
    log = d / "logs" / "worker-cpu-local.log"
    zygote = "flows.warm_engine --worker" in (root / "infra" / "docker-compose.yml").read_text()
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if "started!" in text and (not zygote or "flow-run zygote: ready" in text):
            time.sleep(3)  # a few of its polls
            return
        time.sleep(0.5)
    raise TimeoutError(f"the stack's worker (and zygote) not ready in {TIMEOUT_S} s: {log}")


def _parts(c, flow_run_id, start: float, first: float, state: Path, known: set[Path]) -> dict[str, float]:
    """Where trigger -> first smoke step went, from the flow run's state history and its task runs (server
    clock, the same machine): each part ends where the next begins, so they add up to the whole."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    states = {s.type.value: s.timestamp.timestamp() for s in c.read_flow_run_states(flow_run_id)}
    trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200)
    trs = sorted(trs, key=lambda t: t.start_time)
    snap = next(t for t in trs if t.name.startswith("data-snapshot"))
    unit = next(t for t in trs if t.name == "unit")
    smoke = next(t for t in trs if t.name == "smoke")
    marks = [
        ("worker pick-up (Scheduled -> Pending)", states["PENDING"]),
        ("flow-run process start (Pending -> Running: python, imports, the flow's module)", states["RUNNING"]),
        (
            "flow start to data snapshot (settings, secret blocks, spec check, preflight, entitlement, stale sweep)",
            snap.start_time.timestamp(),
        ),
        ("data snapshot (task)", snap.end_time.timestamp()),
        (
            "MLflow runs opened before the unit stage, spec written (to the unit task's start)",
            unit.start_time.timestamp(),
        ),
        ("unit stage (pytest run, task)", unit.end_time.timestamp()),
        ("gate, recording submitted, smoke's MLflow run (to the smoke task's start)", smoke.start_time.timestamp()),
        ("smoke: admission, torchrun and ranks start, to the first step", first),
    ]
    out, t = {}, start
    for label, end in marks:
        out[label] = end - t
        t = end
    junit = next(p / "unit" / "junit.xml" for p in (state / "runs").iterdir() if p / "smoke" not in known)
    suite = next(ET.parse(junit).getroot().iter("testsuite"))
    out["of the unit stage: pytest's own time, collection to report (junit)"] = float(suite.get("time", "nan"))
    return out


def _traingate_run(tmp: Path) -> dict[str, float]:
    state = tmp / "run-state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "TRAINGATE_", "MLFLOW_"))}
    env.update(TRAINGATE_STATE_DIR=str(state), PREFECT_HOME=str(tmp / "prefect-home"))
    start = time.time()
    with open(tmp / "run.log", "wb") as log:
        p = subprocess.Popen(
            [PYTHON, "-m", "flows.cli", "run", str(SPEC), "--until", "smoke"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        first = _first_step(state, time.monotonic() + TIMEOUT_S)
        if p.wait(timeout=TIMEOUT_S) != 0:
            raise RuntimeError(f"traingate run failed: {(tmp / 'run.log').read_text()[-2000:]}")
    return {"first": first - start, "run": time.time() - start}


def _side_by_side(tmp: Path, ref: str, rounds: int) -> str:
    """The stack half on ``ref``'s code and on this checkout's, alternated ``rounds`` times."""
    if os.geteuid() == 0:
        tmp.chmod(0o711)
    tree = tmp / "baseline-code"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=ROOT, check=True, capture_output=True)
    got: dict[str, list[dict[str, float]]] = {"ref": [], "this": []}
    try:
        for r in range(rounds):
            for name, root in (("ref", tree), ("this", ROOT)):
                (tmp / f"{name}-{r}").mkdir()
                result, _ = _on_stack(tmp / f"{name}-{r}", root)
                got[name].append(result)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = [f"| part (s) | {ref} ({sha}) | this checkout |", "|---|---:|---:|"]

    def cell(rows: list[dict[str, float]], k: str) -> str:
        values = [row[k] for row in rows]
        each = ", ".join(f"{v:.1f}" for v in values)
        return each if len(values) == 1 else f"{each} (mean {sum(values) / len(values):.1f})"

    labels = {"first": "**trigger -> first smoke step**", "run": "trigger -> run Completed, unit + smoke"}
    for k in got["this"][0]:
        out.append(f"| {labels.get(k, k)} | {cell(got['ref'], k)} | {cell(got['this'], k)} |")
    return "\n".join(out)


def main() -> str:
    with tempfile.TemporaryDirectory(prefix="tg-bench-stack-") as t:
        tmp = Path(t)
        if rounds := os.environ.get("TRAINGATE_BENCH_STACK_ENGINES"):
            return _engines(tmp, int(rounds))
        if ref := os.environ.get("TRAINGATE_BENCH_STACK_BASELINE"):
            return _side_by_side(tmp, ref, int(os.environ.get("TRAINGATE_BENCH_STACK_ROUNDS", "1")))
        local = _traingate_run(tmp)
        stack, up_s = _on_stack(tmp)
    rows = [("trigger -> first smoke step (s)", "first"), ("trigger -> run Completed, unit + smoke (s)", "run")]
    out = [
        "| measure | ladder deployment on the running stack | `traingate run` (temporary server) | ratio |",
        "|---|---:|---:|---:|",
    ]
    out += [f"| {label} | {stack[k]:.1f} | {local[k]:.1f} | {stack[k] / local[k]:.2f}x |" for label, k in rows]
    out += [
        "",
        "Where the stack's trigger -> first smoke step went (each part ends where the next begins):",
        "",
        "| part | s |",
        "|---|---:|",
    ]
    out += [f"| {k} | {v:.1f} |" for k, v in stack.items() if k not in ("first", "run")]
    out.append(f"\n(stack up, once, before the clock: {up_s:.1f} s)")
    return "\n".join(out)
