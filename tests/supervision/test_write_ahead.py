"""The orchestrator (the `traingate run` process holding the supervisor) is SIGKILLed before a launch,
mid-step or mid-save; the stage is then resumed as `traingate resume` resumes it (its supervisor.json
handed back in). The attempt in flight was on disk before it launched, the resume decides from the
checkpoints on disk, the step never goes backwards and no checkpoint is overwritten by an earlier step.

Real processes: the stub orchestrator with its guardian, a real torchrun tree of 2 gloo ranks (built-in
recipe) and the shipped examples/script_project2 (script recipe), unmodified.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from tgtest import PYTHON, ROOT, run_processes

from traingate.job import files
from traingate.job.stagejob import derive
from traingate.job.vocab import Cause, Status
from traingate.runtime.checkpoint import Checkpointer
from traingate.settings import Settings
from traingate.spec import load_spec, parse_spec, write_resolved
from traingate.supervision.supervisor import Hooks, read_state, supervise

pytestmark = pytest.mark.slow

STUB = Path(__file__).resolve().parent / "orchestrator_stub.py"
EXAMPLE = ROOT / "examples" / "script_project2"
GRACE_S = 3.0
MOMENTS = ["before_launch", "mid_step", "mid_save"]


def _processes(run_id: str) -> list[psutil.Process]:
    """The live processes of this test's run, under this test's state dir."""
    return run_processes(run_id, os.environ.get("TRAINGATE_STATE_DIR"))


def _wait(predicate: Callable[[], Any], timeout_s: float, what: str, stub: subprocess.Popen, log: Path) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if value := predicate():
            return value
        if stub.poll() is not None:
            raise AssertionError(
                f"the orchestrator exited ({stub.returncode}) before {what}:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}:\n{log.read_text()[-3000:]}")


def _open_attempt(stage_dir: Path) -> bool:
    state = files.read_supervisor_state(stage_dir)
    return bool(state and state.attempts and state.attempts[-1].get("ended_at") is None)


def _orchestrate(spec_path: Path, run_dir: Path, tmp_path: Path, inject: str = "") -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("TRAINGATE_INJECT", None)
    if inject:
        env["TRAINGATE_INJECT"] = inject
    log = tmp_path / "orchestrator.log"
    stub = subprocess.Popen(
        [PYTHON, str(STUB), str(spec_path), str(run_dir), "full", str(GRACE_S)],
        cwd=tmp_path,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return stub, log


def _kill_orchestrator(stub: subprocess.Popen, run_id: str) -> None:
    """SIGKILL, as `kill -9` of the CLI; then its guardian stops the orphaned tree (SIGTERM, grace, SIGKILL)."""
    stub.send_signal(signal.SIGKILL)
    stub.wait(30)
    end = time.monotonic() + GRACE_S + 30
    while (alive := _processes(run_id)) and time.monotonic() < end:
        time.sleep(0.1)
    assert not alive, f"processes of {run_id} outlived the orchestrator: {[p.cmdline() for p in alive]}"


def _resume(spec: Any, run_dir: Path) -> tuple[Any, list[str]]:
    """What `traingate resume` does for the stage: the same job, the stage's supervisor.json handed in."""
    job = derive(spec, "full", run_id=run_dir.name, run_dir=run_dir, settings=Settings.from_env())
    log: list[str] = []
    sup = supervise(job, Hooks(info=log.append), seed=0, resumed=read_state(Path(job.stage_dir)))
    return sup, log


def _check_orphan_record(stage_dir: Path, command_word: str) -> list[dict[str, Any]]:
    attempts = files.read_supervisor_state(stage_dir).attempts
    orphan = attempts[0]
    assert orphan["cause"] == Cause.ORCHESTRATOR_LOST and orphan["retryable"], orphan
    assert orphan["ended_at"] >= orphan["launched_at"]
    assert any(command_word in w for w in orphan["command"]), orphan["command"]  # what it ran, before it ran
    assert attempts[-1]["cause"] is None and attempts[-1]["ended_at"] is not None
    return attempts


# ---------------------------------------------------------------- the script recipe (an unmodified user script)


def _files(ckpt_dir: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(ckpt_dir.glob("ckpt_*.pt"))
    }


def _script_pid(run_id: str) -> int:
    [p] = [p for p in _processes(run_id) if any(a.endswith("train.py") for a in p.cmdline())]
    return p.pid


def _printed(stdout: Path, step: int) -> Callable[[], bool]:
    return lambda: stdout.exists() and f'"step": {step},' in stdout.read_text()


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_script_stage_whose_orchestrator_is_killed_resumes_from_its_newest_checkpoint_and_never_goes_back(
    tmp_path, state_dir, moment
):
    workdir = tmp_path / "project"
    shutil.copytree(EXAMPLE, workdir, ignore=shutil.ignore_patterns("__pycache__"))
    spec = parse_spec(
        {
            "identity": {
                "experiment": "scripts",
                "owner": "tester",
                "team": "platform",
                "purpose": "an orchestrator killed under a script stage",
            },
            "recipe": {
                "name": "script",
                "script": {
                    "workdir": str(workdir),
                    "command": ["python", "train.py", "--ckpt-dir", "${TRAINGATE_CHECKPOINT_DIR}", "--sleep", "0.03"],
                    "stage_args": {"full": ["--max-steps", "100"]},
                    "resume_args": ["--resume-from-latest"],
                    "checkpoints": "ckpt_*.pt",
                    "metrics": [r'"step": (?P<step>\d+), "loss": (?P<loss>[0-9.eE+-]+)'],
                },
            },
            "resources": {"work_pool": "cpu-local", "procs_per_node": 1},
            "supervision": {"backoff_base_s": 0, "backoff_max_s": 0, "hang_timeout_s": 60, "max_restarts": 2},
            "tracking": {"enabled": False},
        }
    )
    spec_path = write_resolved(spec, tmp_path / "spec.yaml")
    run_dir = state_dir / "runs" / f"script-{moment.replace('_', '-')}"
    stage_dir = run_dir / "full"
    stdout = stage_dir / files.STDOUT
    stub, log = _orchestrate(spec_path, run_dir, tmp_path)
    try:
        if moment == "before_launch":
            _wait(lambda: _open_attempt(stage_dir), 120, "the attempt on disk", stub, log)
        elif moment == "mid_step":
            _wait(_printed(stdout, 45), 120, "step 45", stub, log)
        else:  # the script prints a checkpoint's step, then saves it: stopped there, it is killed around its save
            _wait(_printed(stdout, 60), 120, "step 60", stub, log)
            os.kill(_script_pid(run_dir.name), signal.SIGSTOP)
        _kill_orchestrator(stub, run_dir.name)
    finally:
        if stub.poll() is None:
            stub.kill()
    job = derive(spec, "full", run_id=run_dir.name, run_dir=run_dir, settings=Settings.from_env())
    ckpt_dir = Path(job.checkpoint_dir)
    before = _files(ckpt_dir) if ckpt_dir.is_dir() else {}
    k = max((int(re.findall(r"\d+", n)[0]) for n in before), default=None)
    if moment != "before_launch":
        assert k is not None and k >= 40, (k, before)

    printed = len(stdout.read_text().splitlines()) if stdout.exists() else 0

    sup, lines = _resume(spec, run_dir)

    assert sup.status == Status.COMPLETED, sup.error
    attempts = _check_orphan_record(stage_dir, "train.py")
    if k is not None:  # the step its output last showed, read back from the stage's metric points
        assert attempts[0]["end_step"] >= (45 if moment == "mid_step" else 60), attempts[0]
    launch = [line for line in lines if ": launch " in line][0]
    assert ("--resume-from-latest" in launch) == (k is not None), launch
    assert attempts[-1]["resume_from_step"] == k
    resumed = [json.loads(line)["step"] for line in stdout.read_text().splitlines()[printed:] if line.startswith("{")]
    assert resumed == list(range((k or 0) + 1, 101)), resumed[:5]  # from its newest checkpoint, not step 0
    after = _files(ckpt_dir)
    for name, (digest, mtime) in before.items():
        # A checkpoint the killed attempt wrote is kept as it was or removed by the script's own retention
        # (last two): never written again by a launch that started behind it.
        assert after.get(name, (digest, mtime)) == (digest, mtime), name
    for name in after:
        assert json.loads((ckpt_dir / name).read_text())["step"] == int(re.findall(r"\d+", name)[0])


# ---------------------------------------------------------------- the built-in recipe (torchrun, 2 ranks)


def _manifests(uri: str) -> dict[int, float]:
    ck = Checkpointer(uri, async_save=False)
    return {s: ck.manifest(s)["created"] for s in ck.list_steps()}


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_builtin_stage_whose_orchestrator_is_killed_resumes_from_its_latest_checkpoint_and_never_goes_back(
    tiny_spec, tmp_path, state_dir, moment
):
    spec_path = tiny_spec("""
        tracking: {enabled: false}
        stages: {full: {max_steps: 30}}
        supervision: {backoff_base_s: 0.2, backoff_max_s: 1.0, hang_timeout_s: 60, preempt_grace_s: 20}
        checkpoint: {keep_last: 10}
        """)
    spec = load_spec(spec_path)
    run_dir = state_dir / "runs" / f"builtin-{moment.replace('_', '-')}"
    stage_dir = run_dir / "full"
    # rank 0 paces the stage (0.1 s a step) so a kill lands inside it; mid_save: rank 0 stops inside the
    # save of step 15, its files written and its manifest not.
    stub, log = _orchestrate(
        spec_path, run_dir, tmp_path, "slow@0:0" + (",savestop@15:0" if moment == "mid_save" else "")
    )
    try:
        if moment == "before_launch":
            _wait(lambda: _open_attempt(stage_dir), 120, "the attempt on disk", stub, log)
        elif moment == "mid_step":
            _wait(
                lambda: (b := files.read_heartbeats(stage_dir).get(0)) is not None and b.step >= 12,
                180,
                "step 12",
                stub,
                log,
            )
        else:
            _wait(lambda: any((stage_dir / "faults").glob("savestop*")), 180, "the save cut short", stub, log)
        _kill_orchestrator(stub, run_dir.name)
    finally:
        if stub.poll() is None:
            stub.kill()
    job = derive(spec, "full", run_id=run_dir.name, run_dir=run_dir, settings=Settings.from_env())
    before = _manifests(job.checkpoint_uri)
    k = max(before, default=None)
    if moment == "mid_step":
        assert k is not None and k >= 10, before
    if moment == "mid_save":
        # The save cut short is the first at or after step 15 (a restart under load may have taken rank 0 past
        # 15 before it): its files are there, its manifest is not, and the one before it is the newest.
        cut = json.loads(next((stage_dir / "faults").glob("savestop*")).read_text())["step"]
        assert cut >= 15 and k == cut - 5 and cut not in before, (cut, before)

    sup, _ = _resume(spec, run_dir)

    assert sup.status == Status.COMPLETED, sup.error
    attempts = _check_orphan_record(stage_dir, "traingate.runtime.warm")  # a CPU pool: warm restarts by default
    assert attempts[-1]["resume_from_step"] == k
    assert sup.attempts[-1].start_step == (k or 0)  # rank 0 loaded the newest complete checkpoint
    assert files.read_result(stage_dir).steps_done == 30
    after = _manifests(job.checkpoint_uri)
    assert {s: after[s] for s in before} == before  # not one rewritten by a launch that started behind it
    assert max(after) == 30
