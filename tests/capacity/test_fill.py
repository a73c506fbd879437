"""The fill experiment and its placement policies on tiny clusters, against answers worked out by hand."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from flows.cli import main
from traingate.capacity.fill import LEVELS, Cluster, Placement, Workload, fill, parse_placements, unusable
from traingate.capacity.pools import CapacityError

ROOT = Path(__file__).resolve().parents[2]
POOLS = str(ROOT / "examples" / "pools.yaml")


def test_what_a_job_cannot_use_on_a_node_depends_on_its_size():
    state = (100, 600, 1000, 1000)  # free thousandths of a GPU per GPU
    assert unusable(state, 500) == 100  # the 0.1 GPU left is too small for half a GPU
    assert unusable(state, 2000) == 700  # two whole GPUs fit; the partly used ones are stranded
    assert unusable(state, 3000) == 2700  # three whole GPUs do not fit: all of it
    assert unusable(state, 8000) == 2700  # wider than the node: only a wholly free node counts


def test_fgd_keeps_room_for_the_workloads_sizes_where_best_fit_leaves_a_sliver():
    # One node, two GPUs; the trace asks for 0.4 and 0.6 GPUs. After 0.4, best fit puts the next 0.4
    # on the same GPU (0.2 left there, which neither size can use); FGD puts it on the other GPU
    # (0.6 left on each), so both 0.6 jobs that follow fit, and under best fit the second does not.
    arrivals = [400, 400, 600, 600]
    placed = {}
    for policy in Placement:
        cluster = Cluster(1, 2, Workload.of([0.4, 0.6]))
        placed[policy] = [cluster.place(size, policy) for size in arrivals]
        placed[policy].append(cluster.fragmented)
    assert placed[Placement.BESTFIT] == [True, True, True, False, 200 + 400 - 400]  # left (0.2, 0.4): 0.2 stranded
    assert placed[Placement.FGD] == [True, True, True, True, 0]


def test_best_fit_takes_the_tightest_gpu_for_a_fraction_and_the_fullest_node_for_whole_gpus():
    cluster = Cluster(2, 2, Workload.of([0.3, 1.0]))
    assert cluster.place(1000, Placement.BESTFIT)  # node 0: (0, 1000)
    assert cluster.place(300, Placement.BESTFIT)  # node 0's last GPU, not node 1's: (0, 700)
    assert cluster.place(1000, Placement.BESTFIT)  # node 1 only
    assert cluster.place(300, Placement.BESTFIT) and cluster.place(300, Placement.BESTFIT)  # 700 -> 400 -> 100
    assert cluster.allocated == 2900 and cluster.fragmented == 100  # 0.1 GPU that neither size can use


def test_fill_records_each_level_before_the_arrival_that_passes_it():
    # One GPU, every job 0.75: the first fills it to 75%; the second would pass 100%, so arrivals stop.
    curve = fill("p", 1, 1, [0.75], Placement.BESTFIT, runs=2)
    assert len(curve.levels) == LEVELS and curve.levels[74] == 0.75
    assert list(curve.unallocated[:74]) == [1.0] * 74 and list(curve.unallocated[74:]) == [0.25] * 26
    assert list(curve.fragmented[74:]) == [0.25] * 26  # the 0.25 left fits no 0.75 job
    assert curve.first_failure == 1.0 and curve.failed_jobs[-1] == 0


def test_a_job_that_finds_no_room_is_counted_and_the_demand_at_the_first_one_reported():
    # One node of two GPUs, every job 0.6: one on each GPU; the third (demand 1.8 of 2) fits on
    # neither (0.4 left on each), and the fourth would take the demand past 2 GPUs: the end.
    curve = fill("p", 1, 2, [0.6], Placement.FGD, runs=2, seed=5)
    assert curve.first_failure == pytest.approx(0.6)  # 1.2 GPUs had arrived when the third came
    assert curve.failed_jobs[88] == 0 and curve.failed_jobs[89] == 1  # at 0.89 not yet; from 0.9 (1.8 arrived) on
    assert curve.unallocated[-1] == pytest.approx(0.4) and curve.fragmented[-1] == pytest.approx(0.4)


def test_placements_are_parsed_and_an_unknown_one_is_one_line():
    assert parse_placements("fgd, bestfit") == [Placement.FGD, Placement.BESTFIT]
    with pytest.raises(CapacityError, match=r"--placements: 'worst' is not a placement policy; use bestfit, fgd"):
        parse_placements("bestfit,worst")


TRACE = (
    "job_id,submit_s,duration_s,gpus,pools\n"
    "a,0,10,0.25,gpu-a100|gpu-h100\nb,0,10,0.5,gpu-a100\nc,0,10,1,gpu-a100\nd,0,10,0.3,gpu-a100\ne,0,10,2,gpu-a100\n"
)


def test_simulate_fill_writes_a_table_a_csv_and_a_plot_per_pool_and_placement(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    out = tmp_path / "out"
    assert main(["simulate", str(trace), "--pools", POOLS, "--fill", "--fill-runs", "2", "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "fill.csv").open()))
    assert len(rows) == 2 * 2 * LEVELS  # pools (the 0.25 job accepts both) x placements x levels
    assert {(r["pool"], r["placement"]) for r in rows} == {
        (p, q) for p in ("gpu-a100", "gpu-h100") for q in ("bestfit", "fgd")
    }
    assert "| gpu-a100 | fgd | unallocated |" in (out / "fill.md").read_text()
    assert (out / "fill.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("text", "args", "line"),
    [
        (TRACE, ["--placements", "bestfit,worst"], "--placements: 'worst' is not a placement policy"),
        (TRACE, ["--policies", "fifo"], "--policies does nothing with --fill"),
        ("job_id,submit_s,duration_s,gpus,pool\nj,0,1,2.5,gpu-a100\n", [], "line 2: gpus = '2.5': a request above"),
    ],
)
def test_simulate_fill_bad_input_is_one_line_and_exit_2(tmp_path, capsys, text, args, line):
    trace = tmp_path / "t.csv"
    trace.write_text(text)
    assert main(["simulate", str(trace), "--pools", POOLS, "--fill", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert line in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()
