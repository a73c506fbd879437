"""What a run on a Slurm pool costs, on the real Slurm 22.05 test cluster: `traingate cost`, `runs` and `watch`
print the same total. What a preempted and requeued stage is charged (sacct -D: one record per allocation) is
checked on test_engine's preemption scenario, which runs that stage."""
from __future__ import annotations

import json
import re

import yaml

from slurm.test_engine import _tree, slurm_pools  # noqa: F401 (a fixture)


def _dollars(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, text
    return float(m.group(1).replace(",", ""))


def test_runs_cost_and_watch_print_the_same_total_for_a_ladder_on_a_slurm_pool(
        slurm, slurm_pools, state_dir, tmp_path, capsys):
    from flows.cli import main
    from flows.pipeline import pipeline

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(_tree(nodes=1)))
    state = pipeline(str(spec), [], "smoke", return_state=True)
    assert state.is_completed(), state.message
    run_id = state.result()["run_id"]
    smoke = state_dir / "runs" / run_id / "smoke"
    # Smoke stops half way and resumes inside one Slurm job: both halves' attempts are on record.
    assert len(json.loads((smoke / "supervisor.json").read_text())["attempts"]) == 2
    capsys.readouterr()
    assert main(["cost"]) == 0
    cost = _dollars(capsys.readouterr().out, r"slot-hours, \$([\d,.]+);")
    assert main(["runs"]) == 0
    runs = _dollars(capsys.readouterr().out, r"\s\$([\d,.]+)\s+\S+\s*$")
    assert main(["watch", run_id, "--once"]) == 0
    watch = _dollars(capsys.readouterr().out, r"\$([\d,.]+) so far")
    assert cost > 0
    assert f"{cost:.4f}" == f"{runs:.4f}" == f"{watch:.4f}", (cost, runs, watch)
