"""The replay on shared GPUs: requests below one GPU packed beside others, placed best fit or by FGD."""

from __future__ import annotations

import csv
import random

import numpy as np
import pytest

import traingate.capacity.simulate as simulate_module
from flows.cli import main
from traingate.capacity.figures import figures
from traingate.capacity.fill import Workload
from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy
from traingate.capacity.pools import CapacityError, Placement, parse_config
from traingate.capacity.shared import SharedRunning
from traingate.capacity.simulate import TraceJob, simulate, summarize
from traingate.capacity.trace import TraceParams, generate


def config(nodes: int, gpus_per_node: int, placement: str = "bestfit"):
    return parse_config(
        {
            "pools": {
                "p": {"gpus_per_node": gpus_per_node, "nodes": nodes, "price_per_gpu_hour": 1.0, "worker": "process"}
            },
            "simulator": {"placement": placement},
        }
    )


def job(jid: str, submit: float, gpus: float, duration: float, est: float | None = None) -> TraceJob:
    share = round(gpus * 1000) if gpus < 1 else 0
    j = Job(jid, "t", "research", "p", max(1, int(gpus)), submit, est_duration_s=est, milli=share)
    return TraceJob(j, duration, (), gpus if share else None)


def starts(res) -> dict[str, float | None]:
    return {r.job_id: r.first_start_s for r in res.records}


def test_jobs_asking_quarters_of_a_gpu_share_one_instead_of_queueing_for_whole_ones():
    res = simulate([job(f"q{k}", 0.0, 0.25, 100.0) for k in range(4)], config(1, 1), Policy.parse("fifo"))
    assert starts(res) == {f"q{k}": 0.0 for k in range(4)}
    assert [r.footprint for r in res.records] == [0.25] * 4
    assert res.pools[0].busy_gpu_s == 100.0  # four quarters for 100 s: one GPU's worth, counted exactly
    assert summarize(res).utilisation == 1.0
    pool = figures(res)[0]
    assert pool.asked_gpu_h == pool.held_gpu_h == 100.0 / 3600
    assert pool.waits_by_size["<1"].jobs == 4


def test_a_gpu_partly_used_by_fractions_is_not_free_for_a_whole_gpu_job_and_a_fraction_backfills_beside_it():
    # One node of two GPUs. a (0.5) runs 0-100 on GPU 0; b asks both GPUs and waits for a, its reservation
    # 100; c (1 GPU, says 150 s) would end past it and waits; d (0.5, says 50 s) backfills beside a.
    trace = [
        job("a", 0.0, 0.5, 100.0, est=100.0),
        job("b", 1.0, 2, 10.0, est=10.0),
        job("c", 2.0, 1, 150.0, est=150.0),
        job("d", 3.0, 0.5, 50.0, est=50.0),
    ]
    res = simulate(trace, config(1, 2), Policy.parse("fifo+backfill"))
    assert starts(res) == {"a": 0.0, "b": 100.0, "c": 110.0, "d": 3.0}
    assert res.pools[0].busy_gpu_s == 0.5 * 100 + 2 * 10 + 150 + 0.5 * 50


# One node of two GPUs; the trace asks 0.4 and 0.6. Best fit puts b on a's GPU (0.2 left there, which
# neither size can use), so d waits for a or b to end; FGD puts b on the other GPU and d fits at once.
CRAFTED = [job("a", 0.0, 0.4, 1000.0), job("b", 1.0, 0.4, 500.0), job("c", 2.0, 0.6, 1000.0), job("d", 3.0, 0.6, 10.0)]


def test_bestfit_and_fgd_place_a_crafted_trace_differently_and_fgd_strands_less():
    res = {p: simulate(CRAFTED, config(1, 2, p), Policy.parse("fifo")) for p in ("bestfit", "fgd")}
    assert starts(res["bestfit"]) == {"a": 0.0, "b": 1.0, "c": 2.0, "d": 501.0}
    assert starts(res["fgd"]) == {"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0}
    assert summarize(res["fgd"]).fragmented_gpus < summarize(res["bestfit"]).fragmented_gpus


def test_the_placement_flag_of_simulate_changes_where_jobs_go_and_preemption_is_left_out(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "job_id,submit_s,duration_s,gpus\n"
        + "".join(f"{j.job.job_id},{j.job.submit_s},{j.duration_s},{j.gpus}\n" for j in CRAFTED)
    )
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  p: {gpus_per_node: 2, nodes: 1, price_per_gpu_hour: 1.0, worker: process}\n")
    d_start = {}
    for placement in ("bestfit", "fgd"):
        out = tmp_path / placement
        args = ["simulate", str(trace), "--pools", str(pools), "--placement", placement, "--out", str(out)]
        assert main(args) == 0
        rows = {r["job_id"]: r for r in csv.DictReader((out / "schedule-fifo.csv").open())}
        d_start[placement] = float(rows["d"]["first_start_s"])
        table = (out / "table.md").read_text()
        assert f"shared GPUs placed {placement}, no +preempt" in table and "+preempt |" not in table
    assert d_start == {"bestfit": 501.0, "fgd": 3.0}
    assert main(["simulate", str(trace), "--pools", str(pools), "--placement", "worst", "--out", str(tmp_path)]) == 2
    assert "--placement 'worst' is not a placement policy; use one of bestfit, fgd" in capsys.readouterr().err


def test_preemption_on_a_trace_with_fractions_is_refused_in_one_line():
    with pytest.raises(
        CapacityError, match=r"^policy fifo\+preempt: the trace asks fractions of a GPU.*drop \+preempt"
    ):
        simulate(CRAFTED, config(1, 2), Policy.parse("fifo+preempt"))


def sampled(seed: int, n: int = 300) -> list[TraceJob]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for k in range(n):
        t += rng.expovariate(1 / 20)
        out.append(job(f"j{k}", t, rng.choice([0.4, 0.6]), rng.expovariate(1 / 600) + 1))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fgd_leaves_less_fragmented_capacity_than_bestfit_on_a_trace_sampled_with_fractions(seed):
    trace = sampled(seed)
    frag = {p: summarize(simulate(trace, config(4, 4, p), Policy.parse("fifo"))).fragmented_gpus for p in Placement}
    assert frag[Placement.FGD] < frag[Placement.BESTFIT]


def _generated(seed: int, fractions: bool) -> tuple:
    rng = np.random.default_rng(seed)
    gpn, nodes = int(rng.choice([2, 4, 8])), int(rng.integers(2, 6))
    cfg = parse_config(
        {
            "pools": {"p": {"gpus_per_node": gpn, "nodes": nodes, "price_per_gpu_hour": 1.0, "worker": "docker"}},
            "quotas": {"vision": {"p": gpn * nodes * 5 // 8}} if seed % 2 else {},
            "simulator": {"checkpoint_every_s": 600, "restart_cost_s": 60, "preempt_grace_s": 10},
        }
    )
    small = ((0.25, 0.2), (0.5, 0.2), (0.7, 0.1), (1, 0.3), (2, 0.2)) if fractions else TraceParams.small_sizes
    rows = generate(
        TraceParams(
            n_jobs=150,
            capacity=gpn * nodes,
            gpus_per_node=gpn,
            load=float(rng.uniform(0.7, 1.4)),
            seed=seed,
            small_sizes=small,
            small_median_s=600,
            large_median_s=2 * 3600,
        )
    )
    est = rng.uniform(0.3, 2.0, len(rows))
    trace = []
    for k, r in enumerate(rows):
        g = r["gpus"]
        share = round(g * 1000) if g < 1 else 0
        j = Job(
            r["job_id"],
            r["team"],
            r["priority"],
            "p",
            max(1, int(g)),
            round(r["submit_s"] / 300) * 300.0,  # bunched arrivals
            est_duration_s=r["duration_s"] * est[k] if k % 4 == 0 else None,
            checkpoint_every_s=600.0,
            milli=share,
        )
        trace.append(TraceJob(j, r["duration_s"], (), g if share else None))
    return cfg, trace


def _schedule_of(res):
    return [(r.job_id, r.attempts, r.preempted_at, r.limit_stops, r.end_s) for r in res.records]


@pytest.mark.parametrize("seed", range(4))
def test_a_shared_pool_placing_best_fit_decides_a_whole_gpu_trace_as_the_whole_gpu_pool_does(seed, monkeypatch):
    # The shared pool's own placement, GPU bookkeeping and reservation, forced onto a trace without
    # fractions, against the whole-GPU pass the other tests hold to policy.schedule.
    cfg, trace = _generated(seed, fractions=False)
    names = ("fifo+backfill", "sjf+backfill+preempt", "fairshare+backfill+preempt", "priority", "multifactor+backfill")
    plain = {n: simulate(trace, cfg, Policy.parse(n)) for n in names}
    pool = cfg.pools["p"]
    sizes = Workload.of([tj.job.slots for tj in trace])
    monkeypatch.setattr(
        simulate_module,
        "_running",
        lambda *_: SharedRunning(pool.nodes, pool.gpus_per_node, sizes, Placement.BESTFIT),
    )
    for n in names:
        shared = simulate(trace, cfg, Policy.parse(n))
        assert _schedule_of(shared) == _schedule_of(plain[n]), n
        assert [(p.busy_gpu_s, p.team_gpu_s) for p in shared.pools] == [
            (p.busy_gpu_s, p.team_gpu_s) for p in plain[n].pools
        ], n


@pytest.mark.parametrize("seed", range(4))
def test_random_traces_with_fractions_finish_within_capacity_and_fifo_starts_in_submission_order(seed):
    cfg, trace = _generated(seed, fractions=True)
    assert any(tj.job.milli for tj in trace)
    gpn = cfg.pools["p"].gpus_per_node
    for name in ("fifo", "fifo+backfill", "sjf+backfill", "fairshare+backfill", "multifactor+backfill"):
        for placement in Placement:
            c = cfg.model_copy(update={"simulator": cfg.simulator.model_copy(update={"placement": placement})})
            res = simulate(trace, c, Policy.parse(name))
            assert all(r.end_s is not None and r.first_start_s >= r.submit_s for r in res.records)
            # Thousandths held per node never pass its GPUs, at every start.
            spans = [
                (s, e, nodes, round(r.footprint * 1000) // len(nodes))
                for r in res.records
                for (s, nodes, _), e in zip(r.attempts, [*r.preempted_at, r.end_s])
            ]
            for t, _, _, _ in spans:
                held: dict[int, int] = {}
                for s, e, nodes, m in spans:
                    if s <= t < e:
                        for n in nodes:
                            held[n] = held.get(n, 0) + m
                assert max(held.values()) <= gpn * 1000, (name, placement, t)
            if name == "fifo":  # a team held at its quota is passed over; the others start in order
                free = sorted(
                    (r for r in res.records if r.team not in cfg.quotas), key=lambda r: (r.submit_s, r.job_id)
                )
                firsts = [r.first_start_s for r in free]
                assert firsts == sorted(firsts), placement


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--placements", "bestfit,fgd"], "--placements compares placements in the fill experiment (--fill)"),
        (["--fill", "--placement", "fgd"], "--placement places the replay's jobs; --fill compares placements"),
    ],
)
def test_placement_flags_of_the_other_mode_are_one_line_and_exit_2(tmp_path, capsys, args, line):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_s,duration_s,gpus\na,0,10,0.5\n")
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  p: {gpus_per_node: 2, nodes: 1, price_per_gpu_hour: 1.0, worker: process}\n")
    assert main(["simulate", str(trace), "--pools", str(pools), "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert line in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_a_placement_on_a_trace_without_fractions_warns_that_it_does_nothing(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_s,duration_s,gpus\na,0,10,1\n")
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  p: {gpus_per_node: 2, nodes: 1, price_per_gpu_hour: 1.0, worker: process}\n")
    args = ["simulate", str(trace), "--pools", str(pools), "--policies", "fifo", "--placement", "fgd"]
    assert main([*args, "--out", str(tmp_path / "o")]) == 0
    assert "warning: --placement fgd does nothing here: no job asks a fraction of a GPU" in capsys.readouterr().err
