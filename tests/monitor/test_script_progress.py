"""A script that reports its own step total (`step 40/400`): watch's progress and ETA count to it, not to
the spec's max_steps; the step and the rate come from the lines the script printed."""

from __future__ import annotations

import re
import time
from pathlib import Path

from traingate.job import files
from traingate.recipes.script import OutputProgress, extract_metrics

METRICS = [r"step (?P<step>\d+)(?:/(?P<total>\d+))? loss (?P<loss>[0-9.]+)"]


def test_a_total_group_is_the_scripts_step_total_and_not_a_metric(tmp_path):
    progress = OutputProgress(METRICS, tmp_path, attempt=0)
    for line in ("starting", "step 1/400 loss 2.5", "step 2/400 loss 2.25", "step 3 loss 2.0"):
        progress.feed(line)
    assert progress.total == 400 and progress.step == 3
    assert files.read_script_total(tmp_path) == 400
    points = files.read_script_points(tmp_path)
    assert {p.name for p in points} == {"loss"} and [p.step for p in points] == [1, 2, 3]
    assert set(extract_metrics("step 5/10 loss 1.0\n", METRICS)) == {"loss"}


def test_a_script_without_a_total_leaves_no_total_and_watch_counts_to_max_steps(tmp_path):
    progress = OutputProgress([r"step (?P<step>\d+) loss (?P<loss>[0-9.]+)"], tmp_path, attempt=0)
    progress.feed("step 1 loss 2.5")
    assert progress.total is None and files.read_script_total(tmp_path) is None


def _script_stage(run_dir: Path, now: float) -> None:
    """A running full stage whose spec says 200 steps and whose script says 400; 40 steps printed, two a second."""
    stage = run_dir / "full"
    stage.mkdir(parents=True)
    (run_dir / "spec.yaml").write_text("identity: {experiment: scripts}\n")
    files.write_json(
        stage / files.JOB,
        {
            "stage": "full",
            "max_steps": 200,
            "nodes": 1,
            "procs_per_node": 1,
            "slots": 1,
            "price_per_slot_hour": 0.0,
            "launched_at": now - 30,
            "spec": {"optim": {"batch_size": 8}},
        },
    )
    files.write_supervisor_state(stage, files.SupervisorState(job={"stage": "full"}, attempts=[]))
    files.append_script_points(
        stage, [files.ScriptPoint("loss", s, 2.0 / s, now - 20 + s * 0.5, 0) for s in range(1, 41)]
    )
    files.write_script_total(stage, 400)


def test_watch_shows_the_scripts_own_total_and_an_eta_from_its_output(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("COLUMNS", "100")
    _script_stage(tmp_path / "state" / "runs" / "r-script", time.time())
    assert main(["watch", "r-script", "--once"]) == 0
    screen = capsys.readouterr().out
    assert re.search(r"full\s+\S+ 40/400 +10%  ETA 3:00", screen), screen  # (400 - 40) steps at 2 a second
    assert "/200" not in screen, screen
