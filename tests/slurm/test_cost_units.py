"""Slurm allocations -> ledger attempts, on sacct JSON the test cluster printed (tests/slurm/data): no cluster."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from traingate.cost.slurm_cost import Allocation, allocations, charged, untracked_gpus
from traingate.cost.ledger import total_usd
from traingate.job.vocab import Status

DATA = Path(__file__).parent / "data"


def test_an_allocation_is_charged_its_elapsed_times_the_untyped_gres_gpu_count_not_twice_with_the_typed_one():
    text = (DATA / "sacct_preempted_exited.json").read_text()
    jid = str(json.loads(text)["jobs"][0]["job_id"])
    [a] = allocations(text, jid)
    assert (a.gpus, a.end - a.start) == (4, 2)  # gres/gpu 4 and gres/gpu:a100 4: four GPUs
    [att] = charged("r1", "full", "gpu", 3.0, [a], Status.FAILED, requested_gpus=2)
    assert att.slots == 4 and att.outcome == "failed"
    assert total_usd([att]) == pytest.approx(2 / 3600 * 4 * 3.0)


def test_a_requeued_allocation_is_charged_as_preempted_and_the_last_as_the_stage_ended():
    allocs = [Allocation("7", "REQUEUED", 100, 160, 2), Allocation("7", "COMPLETED", 200, 230, 2)]
    first_steps = [{"first_step_time": 110.0}, {"first_step_time": 205.0}]
    out = charged("r1", "full", "gpu", 1.0, allocs, Status.COMPLETED, 2, first_steps)
    assert [(a.number, str(a.outcome), a.held_s, a.idle_s) for a in out] == [
        (0, "preempted", 60.0, 10.0), (1, "completed", 30.0, 5.0)]
    assert total_usd(out) == pytest.approx(90 * 2 / 3600)


def test_an_allocation_without_a_gres_gpu_record_is_charged_the_requested_gpus_and_named_for_the_log():
    allocs = [Allocation("9", "COMPLETED", 0, 3600, 0)]
    [a] = charged("r1", "full", "gpu", 2.0, allocs, Status.COMPLETED, requested_gpus=4)
    assert a.slots == 4 and total_usd([a]) == pytest.approx(8.0)
    assert "Slurm job(s) 9" in untracked_gpus(allocs) and "AccountingStorageTRES=gres/gpu" in untracked_gpus(allocs)
    assert untracked_gpus([Allocation("9", "COMPLETED", 0, 1, 2)]) is None


def test_a_record_that_never_started_holds_nothing():
    text = json.dumps({"jobs": [{"job_id": 5, "state": {"current": "CANCELLED"},
                                 "time": {"start": 50, "end": 50, "elapsed": 0}, "tres": {"allocated": []}}]})
    assert allocations(text, "5") == []
