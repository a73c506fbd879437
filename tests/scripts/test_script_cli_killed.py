"""`traingate run` SIGKILLed mid-full on an unmodified script (examples/script_project2), then `traingate
resume`: the full stage goes on from the script's newest checkpoint through its resume flag, never from
step 0, and rewrites none of the checkpoints the killed attempt left. Real CLI processes on the session's
Prefect server (a server outlives the CLI, as in production); MLflow on SQLite."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tgtest import PYTHON, ROOT, describe, run_processes

pytestmark = pytest.mark.slow

GRACE_S = 30


def _env(tmp: Path, prefect_api: dict[str, str]) -> dict[str, str]:
    env = {
        **os.environ,
        "TRAINGATE_STATE_DIR": str(tmp / "state"),
        "PREFECT_HOME": str(tmp / "prefect"),
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        **prefect_api,
    }
    env.pop("TRAINGATE_INJECT", None)
    return env


def _checkpoints(ckpt_dir: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(ckpt_dir.glob("ckpt_*.pt"))
    }


def test_a_script_run_whose_cli_is_killed_mid_full_resumes_from_its_newest_checkpoint(tmp_path, prefect_api):
    project = tmp_path / "project"
    shutil.copytree(ROOT / "examples" / "script_project2", project, ignore=shutil.ignore_patterns("__pycache__"))
    env = _env(tmp_path, prefect_api)
    out = tmp_path / "run.out"
    cli = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "flows.cli",
            "run",
            str(project / "spec.yaml"),
            "--set",
            f"data.uri={(project / 'data.csv').as_uri()}",
            "--set",
            "recipe.script.stage_args.full=[--max-steps, '300']",
        ],
        cwd=ROOT,
        env=env,
        stdout=open(out, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    runs = tmp_path / "state" / "runs"
    try:
        end = time.monotonic() + 600
        while True:
            log = next(iter(runs.glob("*/full/stdout.log")), None) if runs.is_dir() else None
            if log is not None and '"step": 45,' in log.read_text():
                break
            assert cli.poll() is None, (
                f"the CLI exited ({cli.returncode}) before full's step 45:\n{out.read_text()[-3000:]}"
            )
            assert time.monotonic() < end, out.read_text()[-3000:]
            time.sleep(0.02)
        cli.send_signal(signal.SIGKILL)
        cli.wait(30)
        run_id = log.parent.parent.name
        deadline = time.monotonic() + GRACE_S + 30
        while (alive := describe(run_processes(run_id))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, alive
    finally:
        if cli.poll() is None:
            cli.kill()
        try:
            os.killpg(cli.pid, signal.SIGKILL)  # whatever the CLI started in its session
        except ProcessLookupError:
            pass
    stage_dir = log.parent
    ckpt_dir = Path(
        json.loads((stage_dir / "supervisor.json").read_text())["job"]["checkpoint_uri"].removeprefix("file://")
    )
    before = _checkpoints(ckpt_dir)
    k = max(int(name[5:11]) for name in before)
    printed = len(log.read_text().splitlines())

    p = subprocess.run(
        [PYTHON, "-m", "flows.cli", "resume", run_id], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )

    assert p.returncode == 0 and "resume PASSED" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    attempts = json.loads((stage_dir / "supervisor.json").read_text())["attempts"]
    assert attempts[0]["cause"] == "orchestrator_lost" and attempts[-1]["cause"] is None, attempts
    assert "--resume-from-latest" in attempts[-1]["command"] and attempts[-1]["resume_from_step"] == k
    lines = log.read_text().splitlines()[printed:]
    assert f"resuming from {ckpt_dir}/ckpt_{k:06d}.pt at step {k}" in lines
    steps = [json.loads(line)["step"] for line in lines if line.startswith("{")]
    assert steps == list(range(k + 1, 301)), steps[:5]  # on from its newest checkpoint, not from step 0
    after = _checkpoints(ckpt_dir)
    for name, was in before.items():
        assert after.get(name, was) == was, name  # kept as it was, or removed by the script's own retention
