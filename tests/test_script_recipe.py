"""The script recipe: command building and metric extraction are plain functions."""
from __future__ import annotations

import math

from traingate.recipes.script import build_command, extract_metrics, summarize
from traingate.spec import load_spec_text

BASE = """
identity: {experiment: e, owner: o, team: t, purpose: p}
recipe:
  name: script
  script:
    command: [python, train.py, --lr, "0.1"]
    launcher: %s
    stage_args: {smoke: [--steps, "3"]}
    metrics: ['step (?P<step>\\d+) loss (?P<loss>\\S+)', 'acc=(?P<acc>[0-9.]+)']
"""


def test_plain_script_runs_with_our_python_and_stage_args():
    spec = load_spec_text(BASE % "plain")
    assert build_command(spec, "smoke", "/venv/python", 1) == ["/venv/python", "train.py", "--lr", "0.1",
                                                               "--steps", "3"]
    assert build_command(spec, "full", "/venv/python", 2)[-1] == "0.1"


def test_torchrun_script_is_launched_through_torch_distributed_run():
    spec = load_spec_text(BASE % "torchrun")
    cmd = build_command(spec, "full", "/py", 4)
    assert cmd[:5] == ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    assert cmd[5:] == ["train.py", "--lr", "0.1"]
    multi = build_command(spec, "full", "/py", 8, nnodes=2, rdzv_endpoint="head:29400")
    assert "--nnodes=2" in multi and "--rdzv-endpoint=head:29400" in multi


def test_metrics_are_extracted_by_named_groups_with_steps():
    text = "warmup\nstep 1 loss 2.0 acc=0.1\nstep 2 loss 1.0\nnoise loss\nstep 3 loss nan acc=0.5\n"
    series = extract_metrics(text, ['step (?P<step>\\d+) loss (?P<loss>\\S+)', 'acc=(?P<acc>[0-9.]+)'])
    assert series["loss"][:2] == [(1, 2.0), (2, 1.0)] and math.isnan(series["loss"][2][1])
    assert series["acc"] == [(0, 0.1), (1, 0.5)]
    s = summarize(series)
    assert s["nonfinite_steps"] == 1 and s["loss"] == 1.0 and s["acc"] == 0.5
    assert s["loss_decrease_fraction"] == 0.5 and s["steps"] == 3


def test_an_output_line_reaches_the_reader_before_the_log_so_a_killed_supervisor_leaves_no_line_unrecorded(tmp_path):
    """A script's metric points are recorded by the output reader; the orphaned attempt's last step is read back
    from them. A line must not be in the stage's log before the reader has it: a supervisor killed in between
    would leave a step the log shows and the record lacks."""
    import os
    import sys

    from traingate.launch.proc import run

    log = tmp_path / "stdout.log"
    in_log_first: list[str] = []

    def on_line(line: str) -> None:
        if log.exists() and line in log.read_text().splitlines():
            in_log_first.append(line)

    res = run([sys.executable, "-c", "for i in range(50): print(f'step {i}', flush=True)"], dict(os.environ),
              tmp_path, log, on_line=on_line)
    assert res.returncode == 0
    assert log.read_text().splitlines() == [f"step {i}" for i in range(50)]
    assert in_log_first == []
