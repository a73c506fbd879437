"""Full disks: a stage whose checkpoint store or state directory fills up ends `disk_full` at once.

Each test mounts a real 2 MiB tmpfs (we run as root here) and fills it nearly to the brim, then
runs the full stage under the real supervisor (torchrun, 2 gloo ranks). Expected: no retries,
and ONE line naming the location and how much space is needed - not pages of tracebacks.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from traingate.job.stagejob import derive
from traingate.job.vocab import Cause
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision.supervisor import Hooks, supervise

pytestmark = pytest.mark.slow

SPEC = """
tracking: {enabled: false, log_every: 2}
supervision: {backoff_base_s: 0.2, backoff_max_s: 1.0, hang_timeout_s: 30, preempt_grace_s: 20}
"""
LEFT_FREE = 48 * 1024  # less than one checkpoint of the tiny model with its AdamW state


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 2 MiB tmpfs with about 48 KiB left free."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {p.stderr.strip()}")
    try:
        st = os.statvfs(mnt)
        (mnt / "ballast").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - LEFT_FREE))
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _one_line_disk_full(error: str, where: Path) -> None:
    """The verdict is one line naming where and how much; what follows is at most a short log tail."""
    verdict = error.strip().splitlines()[0]
    assert verdict.startswith("disk_full: ") and str(where) in verdict, verdict
    assert re.search(r"needs? (about |at least )?[\d.]+ ?[KMG]i?B", verdict), verdict  # how much space
    assert "Traceback" not in error, error[:3000]


def _run(tiny_spec, tmp_path: Path, **where: str):
    spec = load_spec(tiny_spec(SPEC), ["stages.full.max_steps=200", "checkpoint.every_steps=50"])
    kw = {}
    if "checkpoint_uri" in where:
        kw["checkpoint_uri"] = where["checkpoint_uri"]
    job = derive(spec, "full", run_id="diskfull", run_dir=Path(where.get("run_dir", tmp_path / "run")),
                 settings=Settings.from_env(), **kw)
    lines: list[str] = []
    t0 = time.monotonic()
    sup = supervise(job, hooks=Hooks(info=lines.append, on_line=lines.append), seed=0)
    return sup, time.monotonic() - t0, lines


def test_a_full_checkpoint_store_stops_the_stage_at_once_with_one_line_naming_it(tiny_spec, tmp_path, state_dir,
                                                                                 small_disk):
    sup, seconds, lines = _run(tiny_spec, tmp_path, checkpoint_uri=(small_disk / "ckpt").as_uri())
    assert sup.cause == Cause.DISK_FULL, sup.error
    assert len(sup.attempts) == 1  # not retried: a full disk stays full
    _one_line_disk_full(sup.error, small_disk)
    assert sum("Traceback" in line for line in lines) <= 2, "\n".join(lines)[-3000:]
    # The checkpointer's own line (rank 0's last words): the space this checkpoint needs and what is free.
    words = [w for w in sup.attempts[0].last_words if w["rank"] == 0]
    assert words and words[0]["cause"] == "disk_full", sup.attempts[0].last_words
    error = words[0]["error"]
    assert "\n" not in error and str(small_disk / "ckpt") in error, error
    free = float(re.search(r"([\d.]+) MiB free at ", error).group(1))
    need = float(re.search(r"needs about ([\d.]+) MiB", error).group(1))
    assert 0 < free < LEFT_FREE / 2**20 + 0.01 and need > free, error


def test_a_full_state_directory_stops_the_stage_at_once_with_one_line_naming_it(tiny_spec, tmp_path, state_dir,
                                                                                small_disk):
    st = os.statvfs(small_disk)  # room for the job file and a few heartbeats, not for a stage's records
    (small_disk / "ballast-2").write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - 24 * 1024))
    sup, seconds, lines = _run(tiny_spec, tmp_path, run_dir=str(small_disk / "run"),
                               checkpoint_uri=(tmp_path / "ckpt").as_uri())
    assert sup.cause == Cause.DISK_FULL, sup.error
    assert len(sup.attempts) == 1
    _one_line_disk_full(sup.error, small_disk)
    assert sum("Traceback" in line for line in lines) <= 2, "\n".join(lines)[-3000:]
