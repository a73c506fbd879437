"""Checkpointing (issue 3): how long training is blocked per checkpoint, and what a failure costs.

1. Stall: a >= 50M-parameter model (a stack of nn.Linear) with AdamW state, on CPU. Per
   checkpoint, the time the training loop is blocked with the async Checkpointer (snapshot
   into reused host buffers; serialise + sha256 + fsync on a background thread) against a
   synchronous ``torch.save`` + fsync of the same state, in the same process. As in
   ``Trainer.run``, the host buffers are prepared before the first step (in the background);
   a second Checkpointer without them measures the first checkpoint as it was before.
   Goals: first checkpoint <= 15% of the synchronous save, steady state <= 10%.
2. Resume: real ``python -m traingate.runtime.train`` processes (char-gpt, ~3.2M parameters)
   SIGKILLed at seeded random steps and relaunched: seconds from process start to the first
   resumed training step, and steps of work lost per failure vs the checkpoint interval.
"""
from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from traingate.job import envvars
from traingate.job.stagejob import derive
from traingate.runtime.checkpoint import Checkpointer
from traingate.settings import Settings
from traingate.spec import load_spec

WIDTH, DEPTH = 2048, 12  # 12 x (2048*2048 + 2048) = 50.4M parameters
SAVES = 3
GOAL_FIRST, GOAL_STEADY = 15.0, 10.0  # % of a synchronous save


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    x = torch.randn(4, WIDTH)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "train_state": {"optimizer": opt.state_dict()}}


def _verdict(pct: float, goal: float) -> str:
    return f"**{pct:.1f}%** (goal <= {goal:.0f}%: {'met' if pct <= goal else 'MISSED'})"


def bench_stall(tmp: Path) -> list[tuple[str, str]]:
    model, opt = _model()
    params = sum(p.numel() for p in model.parameters())
    ck = Checkpointer((tmp / "async").as_uri())
    # What Trainer.run does before its loop: the optimizer has no state yet, so buffers for the
    # weights and AdamW's two moments, faulted in on the writer thread while training starts.
    ck.prepare(model.state_dict(), copies=3)
    base_steps = [_step(model, opt) for _ in range(4)]  # also creates the Adam state
    ck._await_prepared()  # done long before: it must not overlap the synchronous baseline
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3

    sync = []
    for i in range(SAVES):
        path = tmp / f"sync_{i}.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(_state(model, opt), f)
            f.flush()
            os.fsync(f.fileno())
        sync.append(time.perf_counter() - t0)
        path.unlink()
        _step(model, opt)

    blocked, write_s, steps_during = [], [], []
    for i in range(SAVES):
        ck.save(i + 1, _state(model, opt))
        blocked.append(ck.last_blocked_s)
        t0 = time.perf_counter()
        # Train on while the save is written; the next save comes after it is durable (an
        # interval at least as long as the write, so the blocked time is the snapshot only).
        while not ck._inflight.done():
            steps_during.append(_step(model, opt))
        write_s.append(time.perf_counter() - t0)
        ck.wait()
    ck.close()
    prepared_mib = ck._host.nbytes / 2**20

    cold = Checkpointer((tmp / "cold").as_uri())  # no prepare: the first snapshot allocates
    cold.save(1, _state(model, opt))
    cold_first = cold.last_blocked_s
    cold.close()

    quiet = statistics.median(base_steps[1:])
    busy = statistics.median(steps_during) if steps_during else quiet
    steady = statistics.median(blocked[1:])
    sync_med = statistics.median(sync)
    return [
        ("model", f"{DEPTH} x Linear({WIDTH}, {WIDTH}): {params / 1e6:.1f}M parameters, "
                  f"{state_bytes / 2**20:.0f} MiB with AdamW state"),
        ("synchronous torch.save + fsync, per checkpoint (median of 3)", f"{sync_med:.2f} s"),
        ("host buffers prepared before the first step (writer thread, overlaps the first steps)",
         f"{ck.prepare_s:.3f} s for {prepared_mib:.0f} MiB"),
        ("async save, training blocked, first checkpoint", f"{blocked[0]:.3f} s"),
        ("async save, training blocked, steady state (median of 2)", f"{steady:.3f} s"),
        ("**blocked / synchronous, first checkpoint**", _verdict(100 * blocked[0] / sync_med, GOAL_FIRST)),
        ("**blocked / synchronous, steady state**", _verdict(100 * steady / sync_med, GOAL_STEADY)),
        ("first checkpoint without prepare (allocates host buffers): blocked, / synchronous",
         f"{cold_first:.3f} s, {100 * cold_first / sync_med:.1f}%"),
        ("background write (serialise + sha256 + fsync), median", f"{statistics.median(write_s):.2f} s"),
        ("training step while a save is written / without (2 cores shared)",
         f"{busy:.3f} s / {quiet:.3f} s"),
    ]


RESUME_SPEC = """
identity: {experiment: bench, owner: bench, team: platform, purpose: resume cost}
recipe: {name: char-gpt, params: {n_layer: 4, n_embd: 256, n_head: 4, block_size: 32}}
optim: {lr: 0.001, batch_size: 4, seed: 0}
stages: {full: {max_steps: %d}}
checkpoint: {every_steps: %d, keep_last: 2}
tracking: {enabled: false}
"""


def _launch(spec: Path, out: Path) -> subprocess.Popen:
    job = derive(load_spec(spec), "full", run_id="bench", run_dir=out.parent, stage_dir=out,
                 settings=Settings.from_env(), checkpoint_uri=(out / "checkpoints").as_uri()).launch(time.time())
    env = envvars.job_environment(job)  # what a supervised stage gets; this process stands in for the supervisor
    env["OMP_NUM_THREADS"] = "2"
    for var in (envvars.FAULT, envvars.INJECT):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-m", "traingate.runtime.train", "--job", str(job.write())],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _heartbeat(out: Path) -> dict | None:
    try:
        return json.loads((out / "heartbeat.rank0.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def _wait_heartbeat(proc: subprocess.Popen, out: Path, done, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hb = _heartbeat(out)
        if hb and done(hb):
            return hb
        if proc.poll() is not None:
            raise RuntimeError(f"training process exited ({proc.returncode}) early")
        time.sleep(0.01)
    raise RuntimeError("training made no progress within the timeout")


def bench_resume(tmp: Path, kills: int = 3, every: int = 5, max_steps: int = 45) -> list[tuple[str, str]]:
    spec = tmp / "resume.yaml"
    spec.write_text(RESUME_SPEC % (max_steps, every))
    out = tmp / "resume-run"
    rnd = random.Random(3)
    lost, startups = [], []
    killed_at: int | None = None
    for i in range(kills + 1):
        (out / "heartbeat.rank0.json").unlink(missing_ok=True)
        launched = time.time()
        proc = _launch(spec, out)
        hb = _wait_heartbeat(proc, out, lambda h: h["step"] > h["start_step"])
        if killed_at is not None:
            # Launch -> end of the first resumed step (the heartbeat's first_step_time).
            startups.append(hb["first_step_time"] - launched)
            lost.append(killed_at - hb["start_step"])
        if i == kills:
            proc.wait(timeout=600)
            break
        target = hb["start_step"] + rnd.randint(every + 1, 3 * every)
        _wait_heartbeat(proc, out, lambda h: h["step"] >= target)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_at = _heartbeat(out)["step"]
    size = max(sum(f.stat().st_size for f in d.iterdir()) for d in (out / "checkpoints").iterdir())
    return [
        ("resume model", f"char-gpt n_layer 4, n_embd 256 (~3.2M parameters), checkpoint {size / 2**20:.0f} MiB "
                         f"with AdamW state; SIGKILL at {kills} seeded-random steps, checkpoint every {every} steps"),
        ("process start -> end of the first resumed step (imports, find + verify + load, one step)",
         ", ".join(f"{s:.1f} s" for s in startups)),
        (f"steps lost per failure (checkpoint interval {every})",
         ", ".join(str(n) for n in lost) + f" (max {max(lost)})"),
    ]


def main() -> str:
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as d:
        tmp = Path(d)
        rows = bench_stall(tmp)
        rows += bench_resume(tmp)
    lines = ["| checkpointing | measured |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
