"""Full disks: a stage whose checkpoint store or state directory fills up pauses at once (`disk_full`).

Each test mounts a real 2 MiB tmpfs (we run as root here) and fills it nearly to the brim, then
runs the full stage under the real supervisor (torchrun, 2 gloo ranks). Expected: no retries,
and ONE line naming the location and how much space is needed - not pages of tracebacks.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tgtest import PYTHON
from traingate.job.stagejob import derive
from traingate.ladder.preflight import MIN_FREE_BYTES
from traingate.job.vocab import Cause, Status
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
    assert sup.cause == Cause.DISK_FULL and sup.status == Status.PREEMPTED, sup.error  # paused, resumable
    assert "paused by the supervisor" in sup.error.splitlines()[0], sup.error
    assert len(sup.attempts) == 1  # not retried: a full disk stays full
    _one_line_disk_full(sup.error, small_disk)
    assert sup.error.rstrip().endswith("then continue with `traingate resume diskfull`"), sup.error  # resumable
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
    assert sup.cause == Cause.DISK_FULL and sup.status == Status.PREEMPTED, sup.error
    assert len(sup.attempts) == 1
    _one_line_disk_full(sup.error, small_disk)
    assert sum("Traceback" in line for line in lines) <= 2, "\n".join(lines)[-3000:]


# ---------------------------------------------------------------- too little room to start

@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[int], Path]]:
    """make(free_mib): a fresh 100 MiB tmpfs with ``free_mib`` MiB left free."""
    mounts: list[Path] = []

    def make(free_mib: int) -> Path:
        mnt = tmp_path / f"disk-{len(mounts)}"
        mnt.mkdir()
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(mnt)], capture_output=True,
                           text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {p.stderr.strip()}")
        mounts.append(mnt)
        st = os.statvfs(mnt)
        (mnt / "ballast").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - free_mib * 2**20))
        return mnt

    yield make
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _refused_for_room(err: str, field: str, free_mib: int) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    line = lines[0]
    assert line.startswith("traingate: invalid spec: ") and field in line, line
    free = float(re.search(r"only ([\d.]+) MiB free", line).group(1))
    assert abs(free - free_mib) < 1.0 and f"at least {MIN_FREE_BYTES >> 20} MiB" in line, line
    assert "free space there or choose a location on a larger disk" in line, line
    return line


@pytest.mark.parametrize("free_mib", [3, 8, 32])
def test_a_state_dir_with_too_little_room_is_refused_in_one_line_before_anything_starts(
        free_mib, tiny_spec, tmpfs, monkeypatch, capsys):
    from flows.cli import main

    disk = tmpfs(free_mib)
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(disk / "state"))
    rc = main(["run", str(tiny_spec()), "--dry-run"])
    _refused_for_room(capsys.readouterr().err, "TRAINGATE_STATE_DIR", free_mib)
    assert rc == 2 and sorted(p.name for p in disk.iterdir()) == ["ballast"]


@pytest.mark.parametrize("free_mib", [3, 32])
def test_a_checkpoint_store_with_too_little_room_is_refused_in_one_line(free_mib, tiny_spec, tmpfs, state_dir,
                                                                       capsys):
    from flows.cli import main

    disk = tmpfs(free_mib)
    rc = main(["run", str(tiny_spec()), "--dry-run", "--set", f"checkpoint.uri={(disk / 'ckpt').as_uri()}"])
    _refused_for_room(capsys.readouterr().err, "checkpoint.uri", free_mib)
    assert rc == 2 and not state_dir.exists()


def test_a_state_dir_with_room_above_the_floor_passes_the_preflight(tiny_spec, tmpfs, monkeypatch, capsys):
    from flows.cli import main

    disk = tmpfs((MIN_FREE_BYTES >> 20) + 8)
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(disk / "state"))
    assert main(["run", str(tiny_spec()), "--dry-run"]) == 0, capsys.readouterr().err


def test_traingate_run_with_3_mib_free_prints_one_line_and_starts_no_server(tiny_spec, tmpfs, tmp_path):
    """What a user saw: Prefect's temporary server failing on its own database, 1,583 lines, 21 tracebacks."""
    disk = tmpfs(3)
    env = {**os.environ, "TRAINGATE_STATE_DIR": str(disk / "state")}
    env.pop("PREFECT_HOME", None)  # the CLI's own default: inside the state dir, on the small disk
    env.pop("PREFECT_API_URL", None)
    p = subprocess.run([str(Path(PYTHON).parent / "traingate"), "run", str(tiny_spec())], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    _refused_for_room(p.stderr, "TRAINGATE_STATE_DIR", 3)
    assert sorted(q.name for q in disk.iterdir()) == ["ballast"]  # no state dir, no Prefect database


@pytest.mark.timeout(1200)  # a ladder to canary, the run's end, `show` and a resume, on a busy machine
def test_a_checkpoint_store_that_fills_mid_run_pauses_the_run_in_one_line_and_resume_finishes_it(
        tiny_spec, tmpfs, tmp_path, prefect_api, monkeypatch, capsys):
    """Room above the preflight's floor at the start; something else fills the disk once the canary has
    saved its first checkpoint. The run pauses with one line naming the store, its free space and the
    fix; once space is freed, `traingate resume` finishes the same run from that checkpoint."""
    disk = tmpfs((MIN_FREE_BYTES >> 20) + 8)
    spec = tiny_spec("stages: {canary: {max_steps: 40}}")
    env = {**os.environ, **prefect_api, "TRAINGATE_STATE_DIR": str(tmp_path / "state"),
           "TRAINGATE_INJECT": "slow@0"}  # 0.1 s steps: the disk fills while the canary trains
    cli = [PYTHON, "-m", "flows.cli"]
    proc = subprocess.Popen([*cli, "run", str(spec), "--until", "canary", "--set",
                             f"checkpoint.uri={(disk / 'ckpt').as_uri()}"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 400  # unit, smoke and a canary checkpoint: minutes on a busy 2-core machine
    while not list(disk.glob("ckpt/*/canary/*/manifest*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not list(disk.glob("ckpt/*/canary/*/manifest*")):
        code = proc.poll()
        proc.kill()  # its guardian stops the process tree
        raise AssertionError(f"the canary saved no checkpoint within 400 s to fill the disk after (exit {code})")
    _fill(disk / "filler", LEFT_FREE)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("pipeline STOPPED: ")]
    assert len(stopped) == 1, out[-3000:]
    line = stopped[0]
    assert line.startswith("pipeline STOPPED: canary disk_full: paused by the supervisor: ") and str(disk) in line, line
    run_id = re.search(r"MLflow parent run: (\S+)", out).group(1)
    assert line.endswith(f"then continue with `traingate resume {run_id}`"), line
    assert re.search(r"[\d.]+ MiB free, needs about [\d.]+ MiB more", line), line

    from flows.cli import main

    monkeypatch.setenv("TRAINGATE_STATE_DIR", env["TRAINGATE_STATE_DIR"])  # `show` in this process: it reads files
    capsys.readouterr()
    assert main(["show", run_id]) == 0
    shown = capsys.readouterr().out
    assert "stopped in canary: disk_full: paused by the supervisor: no space left on device" in shown, shown
    assert f"then continue with `traingate resume {run_id}`" in shown, shown  # who paused it, why, and the fix

    (disk / "filler").unlink()
    p = subprocess.run([*cli, "resume", run_id, "--until", "canary"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "resume PASSED" in p.stdout, p.stdout
    resumed = re.search(r"canary\s+completed\s.*resumed from step ([\d.]+)", p.stdout)
    assert resumed and float(resumed.group(1)) > 0, p.stdout  # from the checkpoint saved before the disk filled


def _fill(path: Path, leave: int) -> None:
    """Fill ``path``'s disk to ``leave`` bytes free while a stage writes there too (its save may take the rest)."""
    with open(path, "wb") as f:
        while (left := shutil.disk_usage(path.parent).free - leave) > 0:
            try:
                f.write(b"\0" * min(left, 1 << 20))
                f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return
