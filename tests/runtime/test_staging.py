"""A checkpoint store on S3 stages each save in the temp dir, shared with every other process that saves to a
remote store. A new Checkpointer clears the staging left by saves that were killed, and only those: another
process's save in progress keeps its files."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from traingate.runtime.checkpoint import STAGING_PREFIX, Checkpointer


def test_a_new_checkpointer_clears_dead_saves_staging_and_keeps_a_live_processes(s3_server, tmp_path):
    root = tmp_path / "tmp"
    root.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        dirs = {
            "live": root / f"{STAGING_PREFIX}step_00000004-{alive.pid}-abc123",
            "dead": root / f"{STAGING_PREFIX}step_00000004-{dead.pid}-def456",
            "no pid": root / f"{STAGING_PREFIX}step_00000004-gh_789",
        }
        for d in dirs.values():
            d.mkdir()
            (d / "model.pt").write_bytes(b"half an upload")
        (root / "unrelated").mkdir()
        seen: list[str] = []

        def at(phase: str, step: int) -> None:
            if phase == "before_manifest":
                seen.extend(p.name for p in root.iterdir() if p.name.startswith(STAGING_PREFIX))

        ckpt = Checkpointer(f"s3://{s3_server['bucket']}/run", async_save=False, staging_dir=str(root), fault_hook=at)
        assert sorted(p.name for p in root.iterdir()) == sorted([dirs["live"].name, "unrelated"])
        assert (dirs["live"] / "model.pt").read_bytes() == b"half an upload"
        # this process's own saves stage under its pid, and leave nothing behind once uploaded
        ckpt.save(4, {"model": {"w": torch.ones(2)}})
        assert ckpt.find_latest() == 4
        assert [n for n in seen if n != dirs["live"].name] == [n for n in seen if f"step_00000004-{os.getpid()}-" in n]
        assert len(seen) == 2
        assert sorted(p.name for p in root.iterdir()) == sorted([dirs["live"].name, "unrelated"])
        ckpt.close()
    finally:
        alive.kill()
        alive.wait()
