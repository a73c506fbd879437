"""The CUDA path, on a machine with a GPU: the same runtime, NCCL instead of gloo.

Runs the digits example's full stage (tracking off) three ways and compares:
- one process on CUDA (no process group);
- torchrun with NCCL, one rank per visible GPU, SIGKILLed at a step and relaunched from the
  same job (the relaunch resumes from the newest checkpoint and finishes);
- and the same stage on CPU, to compare step times.
The checkpoint of each is loaded back with weights_only; GPU utilisation and memory come from
NVML through the runtime's own system signals. Without a GPU it says so and measures nothing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _job(work: Path, name: str, nproc: int, steps: int):
    from traingate.job.stagejob import JobKind, derive
    from traingate.settings import Settings
    from traingate.spec import load_spec

    spec = load_spec(ROOT / "examples" / "digits.yaml", [
        f"stages.full.max_steps={steps}", "checkpoint.every_steps=20", "tracking.enabled=false",
        f"resources.procs_per_node={nproc}", "resources.work_pool=gpu-h100"])
    job = derive(spec, "full", run_id=f"gpu-{name}", run_dir=work, settings=Settings.from_env(),
                 kind=JobKind.DRILL, stage_dir=work / name, checkpoint_uri=(work / name / "ckpt").as_uri())
    return dataclasses.replace(job.launch(time.time()), procs_per_node=nproc)


def _run(job, env: dict[str, str], kill_at: int | None = None) -> tuple[int, float]:
    from traingate.launch.command import stage_command

    job.write()
    cmd = stage_command(job, sys.executable)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, cwd=job.stage_dir, start_new_session=True,
                         stdout=open(Path(job.stage_dir) / "stdout.log", "ab"), stderr=subprocess.STDOUT)
    if kill_at is not None:
        beat = Path(job.stage_dir) / "heartbeat.rank0.json"
        while p.poll() is None:
            try:
                if json.loads(beat.read_text())["step"] >= kill_at:
                    os.killpg(p.pid, signal.SIGKILL)
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
    return p.wait(), time.monotonic() - t0


def main() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device here: nothing measured (run `python -m bench gpu` on a GPU machine)"
    from traingate.job import files
    from traingate.runtime.checkpoint import Checkpointer

    work = Path(tempfile.mkdtemp(prefix="tg-bench-gpu-"))
    ngpu = torch.cuda.device_count()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cpu_env = {**base, "CUDA_VISIBLE_DEVICES": ""}
    rows = ["| run | device | exit | wall (s) | steps | resumed from | step p50 (ms) | backend | checkpoint loads |",
            "|---|---|---|---|---|---|---|---|---|"]
    plan = [("cpu-1", 1, cpu_env, None), ("cuda-1", 1, base, None), (f"nccl-{ngpu}", ngpu, base, 60)]
    for name, nproc, env, kill_at in plan:
        job = _job(work, name, nproc, 200)
        rc, wall = _run(job, env, kill_at)
        if kill_at is not None:
            rc2, wall2 = _run(job, env)  # the same job again: it must resume and finish
            rc, wall = rc2, wall + wall2
        result = files.read_result(Path(job.stage_dir))
        prof = (result.metrics.get("profile") or {}) if result else {}
        ck = Checkpointer(job.checkpoint_uri, async_save=False)
        latest = ck.find_latest()
        loads = latest is not None and "model" in ck.load(latest)
        log = (Path(job.stage_dir) / "stdout.log").read_text(errors="replace")
        backend = next((b for b in ("nccl", "gloo", "none") if f"(backend {b})" in log), "?")
        rows.append(f"| {name} | {'cpu' if env is cpu_env else torch.cuda.get_device_name(0)} | {rc} | {wall:.1f} | "
                    f"{result.steps_done if result else '-'} | {result.resumed_from_step if result else '-'} | "
                    f"{prof.get('step_time_p50_s', float('nan')) * 1000:.2f} | {backend} | {loads} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(main())
