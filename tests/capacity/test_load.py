"""Offered load of a trace and load scaling by compressing or stretching arrivals, on hand-worked traces."""

from __future__ import annotations

import argparse

import pytest
from tgtest import ROOT

from flows.cli import arguments
from flows.cli import simulate as command
from traingate.capacity.jobs import Job
from traingate.capacity.load import at_load, offered_load
from traingate.capacity.pools import CapacityError, load_config, parse_config
from traingate.capacity.simulate import TraceJob

POOLS = str(ROOT / "examples" / "pools.yaml")
CFG = parse_config(
    {
        "pools": {
            "p": {"gpus_per_node": 4, "nodes": 2, "price_per_gpu_hour": 1.0, "worker": "process"},
            "q": {"gpus_per_node": 8, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"},
        }
    }
)


def tj(job_id: str, submit_s: float, gpus: int, duration_s: float, pool: str = "p", team: str = "t") -> TraceJob:
    return TraceJob(Job(job_id, team, "production", pool, gpus, submit_s, est_duration_s=duration_s / 2), duration_s)


def test_offered_load_is_gpu_seconds_asked_over_the_pools_gpus_times_the_arrival_span():
    # p has 8 GPUs. Asked: 2x400 + 8x100 + 1x800 = 2,400 GPU-s over 8 GPUs x 200 s = 1.5.
    trace = [tj("a", 100.0, 2, 400.0), tj("b", 200.0, 8, 100.0), tj("c", 300.0, 1, 800.0)]
    assert offered_load(trace, CFG) == pytest.approx(1.5)
    # A 5-GPU job holds two whole 4-GPU nodes: its footprint is 8, so it asks 8 x 100 s.
    assert offered_load([tj("a", 0.0, 5, 100.0), tj("b", 100.0, 1, 0.0001)], CFG) == pytest.approx(1.0, rel=1e-5)
    # Over two pools the GPUs are both pools' (8 + 8): the same 2,400 GPU-s, moved half onto q, offer 0.75.
    two = [tj("a", 100.0, 2, 400.0), tj("b", 200.0, 8, 100.0, pool="q"), tj("c", 300.0, 1, 800.0)]
    assert offered_load(two, CFG) == pytest.approx(0.75)


def test_scaling_to_a_load_moves_arrivals_around_the_first_and_keeps_every_job_as_it_was():
    trace = [tj("a", 100.0, 2, 400.0, team="x"), tj("b", 200.0, 8, 100.0), tj("c", 300.0, 1, 800.0)]
    double = at_load(trace, CFG, 3.0)  # twice the load: arrivals twice as close, from the first one on
    assert [t.job.submit_s for t in double] == [100.0, 150.0, 200.0]
    assert offered_load(double, CFG) == pytest.approx(3.0)
    half = at_load(trace, CFG, 0.75)
    assert [t.job.submit_s for t in half] == [100.0, 300.0, 500.0]
    for before, after in zip(trace, half):
        assert (after.job.job_id, after.job.team, after.job.slots, after.job.est_duration_s, after.duration_s) == (
            before.job.job_id,
            before.job.team,
            before.job.slots,
            before.job.est_duration_s,
            before.duration_s,
        )


def test_a_trace_whose_jobs_all_arrive_at_once_or_a_load_out_of_range_is_one_line():
    at_once = [tj("a", 5.0, 1, 10.0), tj("b", 5.0, 1, 10.0)]
    with pytest.raises(CapacityError, match=r"all 2 jobs of the trace arrive at 5 s: .* give the jobs different"):
        at_load(at_once, CFG, 1.0)
    trace = [tj("a", 0.0, 1, 10.0), tj("b", 5.0, 1, 10.0)]
    for bad in (0.0, -1.0, 50.0):
        with pytest.raises(CapacityError, match=rf"--load = {bad:g}: must be between 0.05 and 5"):
            at_load(trace, CFG, bad)


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    arguments.simulate(p)
    return command.main(p.parse_args(argv))


def test_simulate_load_scales_a_trace_read_from_a_file_and_says_so(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    # gpu-h100: 32 GPUs. Asked 8x3600 + 8x3600 = 57,600 GPU-s over 32 GPUs x 3,600 s = 0.5.
    trace.write_text("job_id,submit_s,duration_s,gpus\na,0,3600,8\nb,3600,3600,8\n")
    out = tmp_path / "out"
    assert (
        _main(
            [
                str(trace),
                "--pools",
                POOLS,
                "--pool",
                "gpu-h100",
                "--policies",
                "fifo",
                "--load",
                "1.0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "arrivals scaled from offered load 0.50 to 1" in text
    rows = (out / "schedule-fifo.csv").read_text().splitlines()
    header = rows[0].split(",")
    submits = sorted(float(r.split(",")[header.index("submit_s")]) for r in rows[1:])
    assert submits == [0.0, 1800.0]
    # Without --load the trace replays as recorded, and the table says what it offers.
    assert (
        _main([str(trace), "--pools", POOLS, "--pool", "gpu-h100", "--policies", "fifo", "--out", str(tmp_path / "o2")])
        == 0
    )
    assert "offered load 0.50" in capsys.readouterr().out
    # Out of range: one line, exit 2, nothing written.
    assert (
        _main([str(trace), "--pools", POOLS, "--pool", "gpu-h100", "--load", "9", "--out", str(tmp_path / "o3")]) == 2
    )
    err = capsys.readouterr().err
    assert err.strip() == (
        "traingate simulate: --load = 9: must be between 0.05 and 5 (offered GPU time / the "
        "pools' GPU time; 0.5-1.5 covers an idle to an overloaded cluster)"
    )
    assert not (tmp_path / "o3").exists()
    assert load_config(POOLS).pools["gpu-h100"].capacity == 32
