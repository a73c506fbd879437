"""Recovery: time to recovery per fault kind, where it goes, and goodput with a fault every N steps.

The digits example spec (2 ranks, torchrun, gloo, CPU) under the real supervisor, faults
injected with TRAINGATE_INJECT. Time to recovery runs from the fault (the injector's
timestamp) to the first training step the restarted group completes. It is broken down
with the restarted rank 0's own timeline: fault -> new process (detection, backoff, launch;
for torchrun's in-place restarts: its detection and respawn), imports, rendezvous, model
build + checkpoint load, first step. For a preemption (``term``: SIGTERM to torchrun's agent and every
worker, the supervisor untouched) it also reports the time from the emergency checkpoint written (its
manifest) to the first resumed step. Goodput = useful steps / steps executed; the time ratio
is the undisturbed run's wall time over the disturbed one's, and each fault of the goodput run is
charged what it cost: its time to recovery plus the steps it lost at the undisturbed step time.

A preemption restarted in place is also split at the marks its processes leave: the emergency
checkpoint's manifest, torchrun's agent seeing the group's exit and finishing its rendezvous (its own
log lines: the bench runs the agent with ``LOGLEVEL=INFO``), then the restarted rank 0's timeline.

Everything is measured twice in one invocation: cold starts (each worker a fresh interpreter) and
warm restarts (``supervision.warm_restarts``: workers forked from a pre-imported zygote, see
:mod:`traingate.runtime.warm`). With warm restarts, "imports" is the forked worker's own start-up
(applying the entry's environment, ``train.main`` up to the job read).
"""
from __future__ import annotations

import os
import re
import statistics
import time
from datetime import datetime
from pathlib import Path

from traingate.job.stagejob import JobKind, derive
from traingate.job.vocab import Status
from traingate.runtime import inject
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision.drill import records, steps_executed
from traingate.supervision.supervisor import Supervision, supervise

ROOT = Path(__file__).resolve().parents[1]
HANG_TIMEOUT_S = 5.0
CHECKPOINT_EVERY = 10
# Two faults of each kind in a 60-step run; io faults surface at the save after the failed one.
MTTR_FAULTS = {
    "kill": "kill@15:1,kill@35:0",
    "term": "term@15,term@35",
    "stop": "stop@15:1,stop@35:0",
    "io": "io@12,io@41",
}
GOODPUT_EVERY = 15
GOODPUT_STEPS = 90
PHASES = ("to new process", "imports", "rendezvous", "build + load", "first step")
# A preemption restarted in place, from its emergency checkpoint to the first resumed step: where each part ends.
INPLACE_PARTS = (
    "rank 0's exit seen by the agent",
    "agent's rendezvous",
    "thin entry + fork (worker started)",
    "worker's own start",
    "process group",
    "build + checkpoint load",
    "first step",
)
_AGENT_LINE = re.compile(
    r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d+) .*\] \[default\] (Worker group FAILED|Rendezvous complete)")


def _spec(max_steps: int, warm: bool):
    return load_spec(ROOT / "examples" / "digits.yaml", [
        f"stages.full.max_steps={max_steps}", f"checkpoint.every_steps={CHECKPOINT_EVERY}",
        "checkpoint.keep_last=100",  # every emergency checkpoint's manifest stays to be timed
        "tracking.enabled=false", f"supervision.hang_timeout_s={HANG_TIMEOUT_S}",
        "supervision.backoff_base_s=0.5", "supervision.max_restarts=10",
        f"supervision.warm_restarts={str(warm).lower()}"])


def _run(work: Path, name: str, max_steps: int, faults: str, warm: bool) -> tuple[Supervision, float, list]:
    stage_dir = work / name
    job = derive(_spec(max_steps, warm), "full", run_id=f"bench-{name}", run_dir=work, settings=Settings.from_env(),
                 kind=JobKind.DRILL, stage_dir=stage_dir, checkpoint_uri=(stage_dir / "checkpoints").as_uri(),
                 faults=faults or None)
    t0 = time.monotonic()
    sup = supervise(job, seed=0)
    assert sup.status == Status.COMPLETED, sup.error
    return sup, time.monotonic() - t0, inject.fired(stage_dir)


def _phases(sup: Supervision, fired: list[dict]) -> list[list[float]]:
    """Per recovered fault: seconds spent in each of PHASES."""
    out = []
    for m in fired:
        nxt = next((a for a in sup.attempts if a.launched_at >= m["time"] or
                    a.timeline.get("process_start", 0) >= m["time"]), None)
        t = nxt.timeline if nxt is not None else {}
        if nxt is None or not nxt.first_step_time or not {"process_start", "imported", "rendezvous", "loaded"} <= set(t):
            continue
        marks = [m["time"], t["process_start"], t["imported"], t["rendezvous"], t["loaded"], nxt.first_step_time]
        out.append([b - a for a, b in zip(marks, marks[1:])])
    return out


def _checkpoint_to_step(sup: Supervision, fired: list[dict], stage_dir: Path) -> list[float]:
    """Per recovered preemption: seconds from its emergency checkpoint's manifest to the first resumed step."""
    out = []
    for m in fired:
        ended = next((a for a in sup.attempts if a.ended_at and a.ended_at >= m["time"]), None)
        nxt = next((a for a in sup.attempts if ended is not None and a.number == ended.number + 1), None)
        if ended is None or nxt is None or not nxt.first_step_time or ended.end_step is None:
            continue
        manifest = stage_dir / "checkpoints" / f"step_{ended.end_step:08d}" / "manifest.json"
        if manifest.exists():
            out.append(nxt.first_step_time - manifest.stat().st_mtime)
    return out


def _agent_marks(stage_dir: Path, year: int) -> list[tuple[float, str]]:
    """torchrun's agent's restart marks from the stage's output: (epoch seconds, "Worker group FAILED" or
    "Rendezvous complete"). Its lines carry local time to the microsecond, without the year."""
    out = []
    for line in (stage_dir / "stdout.log").read_text(errors="replace").splitlines():
        if m := _AGENT_LINE.match(line):
            out.append((datetime.strptime(f"{year}{m[1]}", "%Y%m%d %H:%M:%S.%f").timestamp(), m[2]))
    return out


def _inplace_parts(sup: Supervision, fired: list[dict], stage_dir: Path) -> list[list[float]]:
    """Per preemption restarted in place: seconds in each of INPLACE_PARTS, from its emergency checkpoint."""
    out = []
    for m in fired:
        ended = next((a for a in sup.attempts if a.ended_at and a.ended_at >= m["time"]), None)
        nxt = next((a for a in sup.attempts if ended is not None and a.number == ended.number + 1), None)
        if ended is None or nxt is None or not nxt.inplace or not nxt.first_step_time or ended.end_step is None:
            continue
        manifest = stage_dir / "checkpoints" / f"step_{ended.end_step:08d}" / "manifest.json"
        agent = _agent_marks(stage_dir, time.localtime(m["time"]).tm_year)
        seen = next((t for t, what in agent if what == "Worker group FAILED" and t >= m["time"]), None)
        rdzv = next((t for t, what in agent if what == "Rendezvous complete" and seen and t >= seen), None)
        t = nxt.timeline
        if not manifest.exists() or seen is None or rdzv is None or not {"process_start", "imported", "rendezvous",
                                                                          "loaded"} <= set(t):
            continue
        marks = [manifest.stat().st_mtime, seen, rdzv, t["process_start"], t["imported"], t["rendezvous"], t["loaded"],
                 nxt.first_step_time]
        out.append([b - a for a, b in zip(marks, marks[1:])])
    return out


def main(modes: tuple[bool, ...] = (False, True)) -> str:
    os.environ.setdefault("LOGLEVEL", "INFO")  # torchrun's agent logs its restart decision and rendezvous
    work = Settings.from_env().ensure().state_dir / "bench" / "recovery" / time.strftime("%Y%m%d-%H%M%S")
    return "\n\n".join(_tables(work, warm) for warm in modes)


def _tables(work: Path, warm: bool) -> str:
    mode = "warm" if warm else "cold"
    rows = [f"### Warm restarts {'on (workers forked from a zygote)' if warm else 'off (cold interpreter per worker)'}",
            "", "| fault kind | classified as | faults | mean time to recovery (s) | min-max (s) | mean steps lost | "
            + " | ".join(f"{p} (s)" for p in PHASES) + " |", "|---" * (6 + len(PHASES)) + "|"]
    after_ckpt = "not measured"
    split_rows: list[str] = []
    for kind, faults in MTTR_FAULTS.items():
        sup, _, fired = _run(work, f"{mode}-mttr-{kind}", 60, faults, warm)
        recs = [r for r in records(sup, fired) if r.recovery_s is not None]
        mttr = [r.recovery_s for r in recs]
        lost = [r.steps_lost for r in recs if r.steps_lost is not None]
        causes = sorted({str(r.classified_as or "-") for r in recs})
        phases = _phases(sup, list({m["fault"]: m for m in fired}.values()))
        split = [statistics.mean(p[i] for p in phases) if phases else float("nan") for i in range(len(PHASES))]
        rows.append(f"| {kind} | {', '.join(causes)} | {len(recs)} | {statistics.mean(mttr):.1f} | "
                    f"{min(mttr):.1f}-{max(mttr):.1f} | {statistics.mean(lost):.1f} | "
                    + " | ".join(f"{x:.2f}" for x in split) + " |")
        if kind == "term":
            c2s = _checkpoint_to_step(sup, list({m["fault"]: m for m in fired}.values()), work / f"{mode}-mttr-{kind}")
            after_ckpt = ", ".join(f"{x:.2f}" for x in c2s) or "none recovered"
            parts = _inplace_parts(sup, list({m["fault"]: m for m in fired}.values()), work / f"{mode}-mttr-{kind}")
            split_rows = [f"| {name} | " + " | ".join(f"{p[i]:.3f}" for p in parts) + " |"
                          for i, name in enumerate(INPLACE_PARTS)] if parts else []
    rows += ["", f"Preemption (term): emergency checkpoint written -> first resumed step: {after_ckpt} s"]
    if split_rows:
        rows += ["", "Where each in-place preemption's time went, from its emergency checkpoint (s):", "",
                 "| part | " + " | ".join(f"term #{i + 1}" for i in range(split_rows[0].count("|") - 2)) + " |",
                 "|---" * (split_rows[0].count("|") - 1) + "|", *split_rows]

    kinds = ["kill", "term", "stop"]
    plan = [f"{kinds[i % 3]}@{s}" + (":1" if kinds[i % 3] in ("kill", "stop") else "")
            for i, s in enumerate(range(GOODPUT_EVERY, GOODPUT_STEPS - 1, GOODPUT_EVERY))]
    _, ref_s, _ = _run(work, f"{mode}-goodput-reference", GOODPUT_STEPS, "", warm)
    sup, drill_s, fired = _run(work, f"{mode}-goodput-drill", GOODPUT_STEPS, ",".join(plan), warm)
    executed = steps_executed(sup)
    step_s = ref_s / GOODPUT_STEPS
    costs = []
    for r in records(sup, fired):
        lost_s = (r.steps_lost or 0) * step_s
        costs.append(f"| {r.fault} | {r.classified_as or '-'} | "
                     + (f"{r.recovery_s:.2f}" if r.recovery_s is not None else "-")
                     + f" | {r.steps_lost if r.steps_lost is not None else '-'} | {lost_s:.2f} | "
                     + (f"{(r.recovery_s or 0) + lost_s:.2f}" if r.recovery_s is not None else "-") + " |")
    inplace = sum(a.inplace for a in sup.attempts)
    rows += ["", f"Goodput, {GOODPUT_STEPS} steps with a fault every {GOODPUT_EVERY} steps "
                 f"({', '.join(plan)}), checkpoint every {CHECKPOINT_EVERY} steps:", "",
             "| run | restarts (in place) | steps executed | goodput (useful / executed steps) | wall (s) | time ratio |",
             "|---|---|---|---|---|---|",
             f"| undisturbed | 0 | {GOODPUT_STEPS} | 100.0% | {ref_s:.1f} | 1.00 |",
             f"| fault every {GOODPUT_EVERY} steps | {sup.restarts} ({inplace}) | {executed} | "
             f"{GOODPUT_STEPS / executed:.1%} | {drill_s:.1f} | {ref_s / drill_s:.2f} |",
             "", f"What each fault of that run cost (steps lost at the undisturbed {step_s * 1000:.0f} ms/step; "
                 f"the rest of the {drill_s - ref_s:.1f} s difference is launch and exit overhead):", "",
             "| fault | classified as | time to recovery (s) | steps lost | their time (s) | cost (s) |",
             "|---|---|---|---|---|---|", *costs,
             "", f"(hang timeout {HANG_TIMEOUT_S:.0f} s; digits-cnn channels 16, 2 ranks, torchrun + gloo on CPU; "
                 f"warm restarts {'on' if warm else 'off'})"]
    return "\n".join(rows)


if __name__ == "__main__":
    print(main())
