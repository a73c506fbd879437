"""The checkpoint interval is one fact of the StageJob: the training loop saves by it, the supervisor judges
staleness by it and the scheduler prices a preemption by it. Each test gives the StageJob an interval that
differs from its spec's, so a reader that went back to the spec would fail it."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import time
from pathlib import Path

import pytest
from tgtest import PYTHON, ROOT

from traingate.job.catalog import CheckpointCatalog
from traingate.job.stagejob import derive
from traingate.settings import Settings
from traingate.spec import load_spec


def _job(tiny_spec, tmp_path: Path, every_steps: int):
    spec = load_spec(tiny_spec("checkpoint: {every_steps: 50, keep_last: 100, async_save: false}\n"),
                     ["tracking.enabled=false", "resources.procs_per_node=1", "stages.full.max_steps=10",
                      "alerts.checkpoint_stale={factor: 1.0, action: notify}", "supervision.checkpoint_check_s=0.2"])
    stage_dir = tmp_path / "run" / "full"
    job = derive(spec, "full", run_id="interval", run_dir=stage_dir.parent, stage_dir=stage_dir,
                 settings=Settings.from_env(), checkpoint_uri=(stage_dir / "checkpoints").as_uri())
    assert job.checkpoint_every_steps == 50
    return dataclasses.replace(job, checkpoint_every_steps=every_steps, launched_at=time.time())


def test_only_the_stagejob_derives_the_checkpoint_interval_from_the_spec():
    readers = []
    for top in ("traingate", "flows", "tasks"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr in ("every_steps", "every_minutes"):
                    readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers and all(r.startswith("traingate/job/stagejob.py:") for r in readers), readers


@pytest.mark.slow  # a real training process (~10 s here)
def test_the_training_loop_saves_every_stagejob_interval_steps(tiny_spec, tmp_path, state_dir):
    job = _job(tiny_spec, tmp_path, every_steps=3)
    done = subprocess.run([PYTHON, "-m", "traingate.runtime.train", "--job", str(job.write())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # every 3 steps, then the final state
    assert CheckpointCatalog(job.checkpoint_uri).list_steps() == [3, 6, 9, 10]


@pytest.mark.slow  # a supervised stage under torchrun, one rank (~15 s here)
def test_the_loop_saves_and_the_supervisor_judges_staleness_by_the_stagejob_time_interval(
        tiny_spec, tmp_path, state_dir, monkeypatch):
    """The spec says every 50 steps and no time trigger; the StageJob says every 0.06 s. Each step sleeps
    0.1 s (TRAINGATE_INJECT slow@0), so the loop saves at every step and still lags the interval: the
    supervisor's staleness alert fires, naming the StageJob's interval."""
    from traingate.job import files
    from traingate.job.vocab import Status
    from traingate.supervision.supervisor import Hooks, supervise

    monkeypatch.setenv("TRAINGATE_INJECT", "slow@0")
    job = dataclasses.replace(_job(tiny_spec, tmp_path, every_steps=50), checkpoint_every_steps=None,
                              checkpoint_every_s=0.06, launched_at=None)
    assert job.spec.checkpoint.every_minutes is None
    sup = supervise(job, hooks=Hooks(info=lambda m: None), seed=0)
    assert sup.status == Status.COMPLETED, sup.error
    assert CheckpointCatalog(job.checkpoint_uri).list_steps() == list(range(1, 11))  # every 0.06 s: every step
    stale = [a for a in files.read_alerts(Path(job.stage_dir)) if a.rule == "checkpoint-stale"]
    assert stale and "(interval 0.06 s, limit 1x)" in stale[0].message, stale
