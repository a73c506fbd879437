"""What a stage on a Slurm pool costs, from Slurm's accounting (sacct -D: one record per allocation), on the real
Slurm 22.05 test cluster; and `traingate cost`, `runs` and `watch` printing the same total for a run on it."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from slurm.test_engine import _job, _slurm_id, _squeue, _start, _step, _tree, _wait, slurm_pools  # noqa: F401 (a fixture)
from traingate.job.vocab import Status
from traingate.monitor.live import stage_spend_usd

PRICE = 1.0  # the test pool's price_per_gpu_hour


def _records(jid: str) -> list[dict]:
    out = subprocess.run(["sacct", "-D", "-j", jid, "--json"], capture_output=True, text=True, check=True).stdout
    return [j for j in json.loads(out)["jobs"] if str(j["job_id"]) == jid]


def test_a_stage_preempted_and_requeued_is_charged_for_both_of_its_allocations(slurm, tmp_path):
    state = tmp_path / "state"
    victim = _job(state, "victim", _tree(nodes=1, steps=60), "slow@0")
    t, box, log = _start(victim)
    jid = _slurm_id(victim)
    _wait(lambda: (q := _squeue(jid)) is not None and q.state == "RUNNING", "the victim running", log=log)
    node = _squeue(jid).nodes
    _wait(lambda: _step(victim) >= 15, "the victim at step 15", log=log)
    urgent = subprocess.run(["sbatch", "--parsable", "--account=vision", "--qos=urgent", f"--nodelist={node}",
                             "--gres=gpu:a100:2", "--time=2", f"--output={tmp_path}/urgent-%j.out",
                             "--wrap", "sleep 2"], capture_output=True, text=True)
    assert urgent.returncode == 0, urgent.stderr
    t.join(400)
    result = box["result"]
    assert result.status == Status.COMPLETED, log.text()
    assert result.metrics["slurm_requeues"] >= 1, result.metrics
    held = [r for r in _records(jid) if r["time"]["elapsed"] > 0]
    assert len(held) >= 2, held  # sacct -D keeps the preempted allocation beside the one that finished
    charged = result.attempts
    assert [a["outcome"] for a in charged] == ["preempted"] * (len(held) - 1) + ["completed"], charged
    assert [a["held_s"] for a in charged] == [float(r["time"]["elapsed"]) for r in held]
    assert {a["slots"] for a in charged} == {2}  # the allocated gres/gpu of one node
    expected = sum(r["time"]["elapsed"] for r in held) * 2 / 3600 * PRICE
    assert result.cost_usd == pytest.approx(expected) == pytest.approx(sum(a["usd"] for a in charged))
    assert charged[0]["usd"] > 0 and result.cost_usd > charged[-1]["usd"]  # the first allocation is paid for too
    assert stage_spend_usd(Path(victim.stage_dir)) == pytest.approx(result.cost_usd)  # what watch adds up


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
    runs = _dollars(capsys.readouterr().out, r"\s([\d.]+)\s+\S+\s*$")
    assert main(["watch", run_id, "--once"]) == 0
    watch = _dollars(capsys.readouterr().out, r"\$([\d,.]+) so far")
    assert cost > 0
    assert f"{cost:.4f}" == f"{runs:.4f}" == f"{watch:.4f}", (cost, runs, watch)
