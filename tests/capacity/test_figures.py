"""The figures of a replay on handmade traces, against answers worked out by hand."""
from __future__ import annotations

import csv

import pytest

from traingate.capacity.figures import ALL, figures, size_bucket, timeseries
from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy
from traingate.capacity.pools import parse_config
from traingate.capacity.report import _colours, report, write_figures, write_schedule, write_timeseries
from traingate.capacity.simulate import TraceJob, simulate, summarize
from traingate.capacity.trace import TraceParams, generate

SIM = {"checkpoint_every_s": 600, "restart_cost_s": 60, "preempt_grace_s": 10}
TWO = parse_config({
    "pools": {"a": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"},
              "b": {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}},
    "simulator": SIM,
})


def job(jid, pool, gpus, submit, duration, priority="research"):
    return TraceJob(Job(jid, "t", priority, pool, gpus, submit, checkpoint_every_s=600.0), duration)


# Pool a (2 GPUs), FIFO: j1 runs 0-100; j2 (2 GPUs, 5 s) waits for it, 100-105; j3 (1 GPU) waits
# behind j2, 105-305. Waits 0, 100, 55. Pool b (4 GPUs): a (research) runs from 0; the urgent u
# stops it at 700 (100 s since its checkpoint at 600 are lost), runs 700-810 (10 s of grace);
# a resumes at 810, pays 60 s restart, ends at 810 + 60 + 400 = 1270.
TRACE = [
    job("j1", "a", 2, 0, 100), job("j2", "a", 2, 0, 5), job("j3", "a", 1, 50, 200),
    job("x", "b", 4, 0, 1000), job("u", "b", 4, 700, 100, "urgent"),
]


@pytest.fixture(scope="module")
def res():
    return simulate(TRACE, TWO, Policy.parse("fifo+preempt"))


def test_the_replay_is_the_one_worked_out_by_hand(res):
    got = {r.job_id: (r.first_start_s, r.end_s, r.preempted_at) for r in res.records}
    assert got == {"j1": (0, 100, []), "j2": (100, 105, []), "j3": (105, 305, []),
                   "x": (0, 1270, [700]), "u": (700, 810, [])}


def test_wait_percentiles_slowdown_and_makespan_of_three_jobs(res):
    a = figures(res)[0]
    assert (a.scope, a.jobs, a.capacity) == ("a", 3, 2)
    # waits 0, 55, 100; numpy's linear percentiles: p95 = 55 + 0.90 * 45, p99 = 55 + 0.98 * 45
    assert (a.waits.mean_s, a.waits.p50_s, a.waits.max_s) == pytest.approx((155 / 3, 55, 100))
    assert (a.waits.p95_s, a.waits.p99_s) == pytest.approx((95.5, 99.1))
    # bounded slowdown: j1 100/100 = 1; j2 105/max(5, 10) = 10.5 (the 10 s bound); j3 255/200 = 1.275
    assert (a.bsld_mean, a.bsld_max) == pytest.approx(((1 + 10.5 + 1.275) / 3, 10.5))
    assert a.makespan_s == 305
    # held 2*100 + 2*5 + 1*200 GPU-s; while jobs arrive (0-50 s) both GPUs are held
    assert a.held_gpu_h == pytest.approx(410 / 3600) and a.utilisation == 1.0
    assert (a.preemptions, a.preemptive_starts, a.lost_gpu_h) == (0, 0, 0.0)


def test_waits_are_grouped_by_gpus_asked():
    assert [size_bucket(g) for g in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65, 512)] == \
        ["1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-64", "17-64", "65+", "65+"]


def test_waits_by_size_per_pool_and_in_total(res):
    a, b, total = figures(res)
    assert list(a.waits_by_size) == ["1", "2"]
    assert (a.waits_by_size["1"].jobs, a.waits_by_size["1"].max_s) == (1, 55)
    assert (a.waits_by_size["2"].jobs, a.waits_by_size["2"].mean_s, a.waits_by_size["2"].max_s) == (2, 50, 100)
    assert list(b.waits_by_size) == ["3-4"] and b.waits_by_size["3-4"].max_s == 0
    assert total.scope == ALL and total.waits_by_size["3-4"].jobs == 2 and total.waits_by_size["2"].jobs == 2


def test_every_preemption_and_the_gpu_time_it_cost_are_counted(res):
    b = figures(res)[1]
    # x stopped once; u started by the preemption rule. Lost: x held 700 + 460 s for 1000 s of work
    # (100 s since its checkpoint + 60 s restart) and u 110 s for 100 s (10 s grace), on 4 GPUs.
    assert (b.preemptions, b.preemptive_starts) == (1, 1)
    assert b.lost_gpu_h == pytest.approx(4 * (160 + 10) / 3600)
    assert b.lost_gpu_h == pytest.approx(summarize(simulate(TRACE[3:], TWO, Policy.parse("fifo+preempt"))).wasted_gpu_h)
    # bounded slowdown: x 1270/1000, u 110/100
    assert b.bsld_mean == pytest.approx((1.27 + 1.1) / 2) and b.makespan_s == 1270


def test_an_urgent_start_that_stops_nothing_still_counts_as_a_preemptive_start():
    # The 2-GPU head h waits behind r (2 of 4 GPUs); FIFO lets nothing past it, but the 1-GPU urgent u
    # starts by the preemption rule without a victim and pays the 10 s grace.
    trace = [job("r", "b", 2, 0, 100), job("h", "b", 4, 1, 50), job("u", "b", 1, 2, 20, "urgent")]
    (b, _) = figures(simulate(trace, TWO, Policy.parse("fifo+preempt")))
    assert (b.preemptions, b.preemptive_starts) == (0, 1)
    assert b.lost_gpu_h == pytest.approx(10 / 3600)


def test_the_total_is_over_all_jobs_and_all_gpus(res):
    total = figures(res)[-1]
    assert (total.jobs, total.capacity, total.makespan_s) == (5, 6, 1270)
    assert total.waits.max_s == 100 and total.preemptions == 1 and total.preemptive_starts == 1
    assert total.held_gpu_h == pytest.approx((410 + 4 * 1270) / 3600)
    # utilisation while jobs arrive, each pool over its own window: a 0-50 s, both GPUs held; b 0-700 s, all four
    assert total.utilisation == pytest.approx((2 * 50 + 4 * 700) / (2 * 50 + 4 * 700))
    assert total.utilisation == pytest.approx(summarize(res).utilisation)


def test_queue_length_and_utilisation_over_time_are_exact_interval_averages(res):
    series = timeseries(res, bins=10)  # 0-1270 s in 127 s intervals
    a = [i for i in series if i.scope == "a"]
    b = [i for i in series if i.scope == "b"]
    total = [i for i in series if i.scope == ALL]
    assert len(a) == len(b) == len(total) == 10 and (a[0].start_s, a[-1].end_s) == (0, 1270)
    # pool a, 0-127 s: j2 queued 0-100 and j3 50-105 -> (100 + 55) / 127 jobs, at most 2
    assert (a[0].queued_mean, a[0].queued_max) == (pytest.approx(155 / 127), 2)
    # GPUs held on a: 2 for 0-105, 1 for 105-127 -> (210 + 22) / 127 of 2
    assert a[0].busy_gpus_mean == pytest.approx(232 / 127) and a[0].utilisation == pytest.approx(232 / 254)
    assert a[-1].busy_gpus_mean == 0 and a[-1].queued_max == 0
    # pool b: all 4 GPUs held throughout; x queued 700-810, inside the interval 635-762 for 62 s
    assert all(i.busy_gpus_mean == pytest.approx(4) for i in b)
    assert (b[5].queued_mean, b[5].queued_max) == (pytest.approx(62 / 127), 1)
    assert all(t.queued_mean == pytest.approx(x.queued_mean + y.queued_mean) for t, x, y in zip(total, a, b))
    assert all(t.capacity == 6 for t in total)
    # the integral of GPUs held is the replay's own
    assert sum(i.busy_gpus_mean * (i.end_s - i.start_s) for i in total) == \
        pytest.approx(sum(p.busy_gpu_s for p in res.pools))


def test_csvs_keep_every_digit_and_the_report_has_the_per_pool_and_size_tables(res, tmp_path):
    trace = [job("p", "a", 1, 1e-7, 123456789.123456789), job("q", "a", 2, 200000000.5, 3.3)]
    r = simulate(trace, TWO, Policy.parse("fifo"))
    with write_schedule(r, tmp_path / "s.csv").open() as f:
        rows = {row["job_id"]: row for row in csv.DictReader(f)}
    assert float(rows["p"]["submit_s"]) == 1e-7 and float(rows["p"]["end_s"]) == 1e-7 + 123456789.123456789
    start, end = rows["p"]["attempts (start-end@nodes:how)"].split("@")[0].split("-")
    assert (float(start), float(end)) == (1e-7, 1e-7 + 123456789.123456789)
    assert float(rows["q"]["end_s"]) == 200000000.5 + 3.3
    with write_timeseries(timeseries(r, bins=3), tmp_path / "t.csv").open() as f:
        ts = list(csv.DictReader(f))
    assert len(ts) == 6 and float(ts[0]["start_s"]) == 1e-7 and float(ts[-1]["end_s"]) == 200000000.5 + 3.3
    fig, sizes = write_figures([res], [figures(res)], tmp_path)
    with fig.open() as f:
        got = {row["pool"]: row for row in csv.DictReader(f)}
    assert float(got["a"]["wait_mean_s"]) == 155 / 3 and float(got["a"]["bsld_mean"]) == (1 + 10.5 + 1.275) / 3
    assert got[ALL]["preemptions"] == "1" and got[ALL]["preemptive_starts"] == "1"
    assert len(sizes.read_text().splitlines()) == 1 + 2 + 1 + 3  # header, a: 1 and 2, b: 3-4, all: 1, 2, 3-4
    text = report([res], "t")
    assert "| fifo+preempt | a | 3 | 2 | 55.00 | 95.50 | 99.10 | 100.00 | 4.26 / 9.58 / 10.50 | 5.08 | 100.0% " in text
    assert "| fifo+preempt | all | 5 | 6 |" in text and "| 1 | 1 | 0.19 |" in text
    assert "| 100.0% | 0.00 (0.0%) | 1 / 1 | 0.2 |" in text  # the comparison table counts both too


@pytest.mark.parametrize("n", [2, 10, 12, 20])
def test_the_plots_give_each_policy_its_own_colour(n):
    assert len(set(_colours(n))) == n


def test_a_backfilled_job_stopped_at_its_limit_is_counted_apart_from_preemptions(tmp_path):
    # Pool b (4 GPUs), FIFO + backfill: a (2 GPUs) runs 0-100; the 4-GPU head h is reserved for 100;
    # b (2 GPUs) says 50 s but needs 300: backfilled at 2, stopped at its limit 52 (50 s of work, no
    # checkpoint yet), queued again 52-150, resumes after h with 60 s restart: 150 + 60 + 300 = 510.
    def est(jid, gpus, submit, duration, estimate):
        return TraceJob(Job(jid, "t", "research", "b", gpus, submit, estimate, checkpoint_every_s=600.0), duration)

    res = simulate([est("a", 2, 0, 100, 100), est("h", 4, 1, 50, 50), est("b", 2, 2, 300, 50)], TWO,
                   Policy.parse("fifo+backfill"))
    assert {r.job_id: (r.first_start_s, r.end_s, r.limit_stops) for r in res.records} == \
        {"a": (0, 100, []), "h": (100, 150, []), "b": (2, 510, [52])}
    b = figures(res)[0]
    assert (b.preemptions, b.preemptive_starts, b.lost_gpu_h) == (0, 0, 0.0)
    with write_schedule(res, tmp_path / "s.csv").open() as f:
        row = [r for r in csv.DictReader(f) if r["job_id"] == "b"][0]
    assert (row["preemptions"], row["limit_stops"], row["attempts (start-end@nodes:how)"]) == \
        ("0", "1", "2-52@0:backfill;150-510@0:in order")
    assert b.limit_stops == 1 and b.lost_limit_gpu_h == pytest.approx(2 * (50 + 60) / 3600)
    (q,) = [i for i in timeseries(res, bins=51) if i.scope == "b" and i.start_s == 50]  # 10 s intervals
    assert (q.queued_mean, q.queued_max) == (pytest.approx((10 + 8) / 10), 2)  # h all along, b from 52


def test_on_a_generated_trace_the_figures_agree_with_the_replay_under_every_kind_of_stop():
    cfg = parse_config({"pools": {"p": {"gpus_per_node": 4, "nodes": 4, "price_per_gpu_hour": 1.0,
                                        "worker": "process"}}, "simulator": SIM})
    rows = generate(TraceParams(n_jobs=300, capacity=16, gpus_per_node=4, load=0.9, seed=7, small_median_s=600,
                                classes=(("urgent", 0.15), ("production", 0.3), ("research", 0.55)),
                                large_median_s=3 * 3600))
    trace = [job(r["job_id"], "p", r["gpus"], r["submit_s"], r["duration_s"], r["priority"]) for r in rows]
    res = simulate(trace, cfg, Policy.parse("fairshare+backfill+preempt"))
    f = figures(res)[0]
    assert f.preemptions > 0 and f.preemptive_starts >= f.preemptions // 2 and f.limit_stops > 0
    assert f.lost_gpu_h + f.lost_limit_gpu_h == pytest.approx(summarize(res).wasted_gpu_h)
    assert f.utilisation == pytest.approx(summarize(res).utilisation)
    series = [i for i in timeseries(res) if i.scope == "p"]
    assert min(i.queued_mean for i in series) >= 0 and series[-1].queued_max == 0
    assert max(i.busy_gpus_mean for i in series) <= 16 + 1e-9
    assert sum(i.busy_gpus_mean * (i.end_s - i.start_s) for i in series) == pytest.approx(res.pools[0].busy_gpu_s)
