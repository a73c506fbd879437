"""Each policy rule on plain data: order, strict head, backfill, quotas, preemption."""
from __future__ import annotations

import pytest

from traingate.capacity.jobs import Job, started
from traingate.capacity.policy import (How, Order, Policy, Rules, choose_victims, never_fits, queue_order,
                                       reserve, schedule)
from traingate.capacity.pools import CapacityError, PoolConfig, _default_classes, parse_config
from traingate.capacity.queue import RUNNING, Entry, decide

CLASSES = _default_classes()
POOL = PoolConfig(gpus_per_node=4, nodes=2, price_per_gpu_hour=1.0, worker="process")


def job(jid, slots=1, submit=0.0, team="t", cls="research", est=None, ckpt=None):
    return Job(jid, team, cls, "p", slots, submit, est_duration_s=est, checkpoint_every_s=ckpt)


def run(j, at, nodes, overhead=0.0):
    return started(j, at, nodes, overhead)


def est(j):
    return j.est_duration_s


def rules(name, quotas=None, restart=0.0):
    return Rules(Policy.parse(name), CLASSES, quotas or {}, restart)


def plan(name, running, waiting, now=100.0, usage=None, quotas=None, restart=0.0):
    return schedule(now, POOL, running, waiting, rules(name, quotas, restart), usage or {}, est)


# ------------------------------------------------------------------ order

def test_fifo_serves_submission_order_whatever_the_class():
    w = [job("u", submit=5, cls="urgent"), job("r", submit=1)]
    assert [j.job_id for j in queue_order(w, Policy(Order.FIFO), CLASSES, {}, est)] == ["r", "u"]


def test_priority_serves_urgent_then_production_then_research_each_in_submission_order():
    w = [job("r1", submit=0), job("p1", submit=3, cls="production"), job("u1", submit=4, cls="urgent"),
         job("p0", submit=2, cls="production")]
    assert [j.job_id for j in queue_order(w, Policy(Order.PRIORITY), CLASSES, {}, est)] == ["u1", "p0", "p1", "r1"]


def test_sjf_serves_the_shortest_predicted_remaining_work_first_and_unknown_last():
    w = [job("long", est=500), job("unknown"), job("short", est=50, submit=9),
         Job("resumed", "t", "research", "p", 1, 0.0, est_duration_s=400, done_s=380)]
    assert [j.job_id for j in queue_order(w, Policy(Order.SJF), CLASSES, {}, est)] == ["resumed", "short", "long", "unknown"]


def test_policy_names_parse_and_bad_ones_name_the_fix():
    assert Policy.parse("fairshare+backfill+preempt") == Policy(Order.FAIRSHARE, True, True)
    assert Policy.parse("sjf+preempt").name == "sjf+preempt"
    with pytest.raises(CapacityError, match="'lifo' is not an order; use one of"):
        Policy.parse("lifo")
    with pytest.raises(CapacityError, match="'backfil' is not a modifier"):
        Policy.parse("fifo+backfil")


# ------------------------------------------------------------------ aged order (the starvation bound)

H = 3600.0


def aged_rules(name, bound_h=24.0):
    return Rules(Policy.parse(name), CLASSES, {}, starvation_bound_s=bound_h * H)


def test_an_aged_order_serves_jobs_past_the_starvation_bound_first_oldest_first_whatever_their_class():
    w = [job("u", submit=49 * H, cls="urgent"), job("p", submit=40 * H, cls="production"),
         job("r2", submit=20 * H), job("r1", submit=10 * H, team="heavy"), job("p0", submit=25 * H, cls="production")]
    usage = {"heavy": 100.0}
    # At 50 h with a 24 h bound: r1 (waited 40 h), p0 (25 h) and r2 (30 h) are past it, oldest first;
    # then class order and fair share as without the bound.
    aged = queue_order(w, Policy.parse("fairshare+aged"), CLASSES, usage, est, now=50 * H, starvation_bound_s=24 * H)
    assert [j.job_id for j in aged] == ["r1", "r2", "p0", "u", "p"]
    plain = queue_order(w, Policy.parse("fairshare"), CLASSES, usage, est, now=50 * H)
    assert [j.job_id for j in plain] == ["u", "p0", "p", "r2", "r1"]
    # Before anyone reaches the bound the aged order is the class order.
    early = queue_order(w, Policy.parse("fairshare+aged"), CLASSES, usage, est, now=49 * H, starvation_bound_s=48 * H)
    assert [j.job_id for j in early] == [j.job_id for j in plain]


def test_a_research_job_past_the_bound_takes_the_free_gpu_a_newer_production_job_takes_without_it():
    busy = [run(job("x", slots=4), 0.0, (0,)), run(job("y", slots=3), 0.0, (1,))]  # one GPU free, on node 1
    w = [job("r", submit=0.0), job("p", submit=90 * H, cls="production")]
    now = 100 * H
    aged = schedule(now, POOL, busy, w, aged_rules("fairshare+aged+backfill+preempt"), {}, est)
    assert [(s.job_id, s.nodes) for s in aged.starts] == [("r", (1,))] and aged.head == "p"
    plain = schedule(now, POOL, busy, w, aged_rules("fairshare+backfill+preempt"), {}, est)
    assert [(s.job_id, s.nodes) for s in plain.starts] == [("p", (1,))] and plain.head == "r"


def test_an_aged_wide_job_is_the_head_and_holds_its_reservation_against_newer_higher_class_jobs():
    # The aged 8-GPU job is first in order but cannot start: it becomes the head, reserved when both
    # running jobs have ended (100 s from now); the production job predicted to run past that does not backfill.
    busy = [run(job("x", slots=4, est=1000.0), 50 * H - 950.0, (0,)), run(job("y", slots=2, est=100.0), 50 * H, (1,))]
    w = [job("wide", slots=8, submit=0.0), job("p", slots=2, submit=49 * H, cls="production", est=600.0)]
    aged = schedule(50 * H, POOL, busy, w, aged_rules("fairshare+aged+backfill"), {}, est)
    assert aged.head == "wide" and aged.reserved_s == 50 * H + 100.0 and aged.starts == ()
    plain = schedule(50 * H, POOL, busy, w, aged_rules("fairshare+backfill"), {}, est)
    assert [s.job_id for s in plain.starts] == ["p"] and plain.head == "wide"


def test_aged_policy_names_parse_and_orders_that_age_already_are_refused():
    assert Policy.parse("fairshare+backfill+aged+preempt") == Policy(Order.FAIRSHARE, True, True, aged=True)
    assert Policy.parse("sjf+aged").name == "sjf+aged"
    with pytest.raises(CapacityError, match=r"'fifo\+aged': fifo serves the oldest first already; drop \+aged"):
        Policy.parse("fifo+aged")
    with pytest.raises(CapacityError, match="multifactor ages by its weight_age; drop"):
        Policy.parse("multifactor+aged+backfill")


def test_the_configs_starvation_bound_makes_the_default_aged_and_null_switches_it_off():
    pools = {"p": {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}}
    on = parse_config({"pools": pools, "scheduling": {"starvation_bound_h": 12}})
    assert Policy.default(on.scheduling).name == "fairshare+aged+backfill+preempt"
    assert Rules.of(Policy.default(on.scheduling), on, "p").starvation_bound_s == 12 * H
    assert Rules.of(Policy.parse("fairshare+backfill"), on, "p").starvation_bound_s is None
    off = parse_config({"pools": pools, "scheduling": {"starvation_bound_h": None}})
    assert Policy.default(off.scheduling).name == "fairshare+backfill+preempt"
    with pytest.raises(CapacityError) as e:
        Rules.of(Policy.parse("fairshare+aged"), off, "p")
    assert str(e.value) == (
        "policy fairshare+aged: +aged needs a starvation bound, but scheduling.starvation_bound_h is null; "
        "set it (hours, e.g. 24) or drop +aged"
    )


def test_the_local_engine_decides_by_the_same_bound_and_shows_the_aged_job_first_in_its_queue():
    now = 1_000_000.0
    tree = {"pools": {"p": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}}}
    busy = Entry("x", "x", "full", "a", "research", "p", 1, submit_s=0.0, state=RUNNING, beat_s=now, started_s=0.0,
                 nodes=(0,))
    old = Entry("old", "old", "full", "a", "research", "p", 1, submit_s=now - 2 * H, beat_s=now)
    new = Entry("new", "new", "full", "b", "production", "p", 1, submit_s=now - 60.0, beat_s=now)
    on = parse_config({**tree, "scheduling": {"starvation_bound_h": 1}})
    d_old, d_new = (decide(j, [busy, old, new], on, now, {}) for j in ("old", "new"))
    assert (d_old.start, d_old.position, d_new.start, d_new.position) == (True, 1, False, 2)
    off = parse_config({**tree, "scheduling": {"starvation_bound_h": None}})
    d_old, d_new = (decide(j, [busy, old, new], off, now, {}) for j in ("old", "new"))
    assert (d_old.start, d_old.position, d_new.start, d_new.position) == (False, 2, True, 1)


# ------------------------------------------------------------------ gang and strict order

def test_a_gang_job_starts_only_when_all_its_slots_fit_and_then_on_whole_nodes():
    p = plan("fifo", [run(job("x"), 0.0, (0,))], [job("wide", slots=8)])
    assert p.starts == () and p.head == "wide"
    p = plan("fifo", [], [job("wide", slots=8)])
    assert p.starts[0].nodes == (0, 1)


def test_without_backfill_a_small_job_does_not_pass_a_blocked_wide_job():
    p = plan("fifo", [run(job("x"), 0.0, (0,))], [job("wide", slots=8, submit=1), job("small", submit=2)])
    assert p.starts == () and p.head == "wide"


# ------------------------------------------------------------------ backfill

def test_the_head_is_reserved_at_the_predicted_end_that_frees_its_nodes():
    running = [run(job("a", slots=4, est=100), 0.0, (0,)), run(job("b", slots=2, est=30), 0.0, (1,))]
    # b ends at 30 (node 1 whole again), a at 100: an 8-GPU job needs both -> 100; a 4-GPU job -> 30
    assert reserve(job("w8", slots=8), 10.0, [0, 2], running, 4, est) == 100.0
    assert reserve(job("w4", slots=4), 10.0, [0, 2], running, 4, est) == 30.0


def test_a_job_past_its_prediction_or_without_one_is_predicted_to_run_as_long_again():
    running = [run(job("late", slots=4, est=50), 0.0, (0,)), run(job("unknown", slots=4), 60.0, (1,))]
    assert reserve(job("w", slots=4), 80.0, [0, 0], running, 4, est) == 100.0    # unknown: 80 + 20
    assert reserve(job("w", slots=8), 80.0, [0, 0], running, 4, est) == 160.0    # late: 80 + 80


def test_backfill_starts_a_small_job_that_ends_before_the_reservation_and_refuses_one_that_does_not():
    running = [run(job("a", slots=4, est=200), 0.0, (0,)), run(job("b", slots=2, est=200), 0.0, (1,))]
    waiting = [job("wide", slots=8, submit=1), job("fits", slots=2, submit=2, est=100),
               job("too-long", slots=1, submit=3, est=101), job("unknown", slots=1, submit=4)]
    p = plan("fifo+backfill", running, waiting)
    # reserved start 200 = now 100 + ...: 'fits' ends at 200, 'too-long' at 201, 'unknown' cannot be trusted
    assert p.head == "wide" and p.reserved_s == 200.0
    assert [(s.job_id, s.how) for s in p.starts] == [("fits", How.BACKFILL)]


def test_a_resumed_job_is_backfilled_on_its_remaining_work_plus_its_restart_cost():
    running = [run(job("a", slots=4, est=200), 0.0, (0,)), run(job("b", slots=2, est=200), 0.0, (1,))]
    resumed = Job("r", "t", "research", "p", 2, 1.0, est_duration_s=300, done_s=250, overhead_s=50)
    p = plan("fifo+backfill", running, [job("wide", slots=8), resumed])
    assert [s.job_id for s in p.starts] == ["r"]        # 100 + 50 + (300 - 250) = 200 <= 200
    late = Job("r", "t", "research", "p", 2, 1.0, est_duration_s=300, done_s=249, overhead_s=50)
    assert plan("fifo+backfill", running, [job("wide", slots=8), late]).starts == ()


# ------------------------------------------------------------------ quotas

def test_a_team_at_its_quota_waits_while_another_teams_job_starts():
    running = [run(job("v1", slots=2, team="vision"), 0.0, (0,))]
    waiting = [job("v2", slots=2, team="vision", submit=1), job("s1", slots=2, team="speech", submit=2)]
    p = plan("fifo", running, waiting, quotas={"vision": 3})
    assert [s.job_id for s in p.starts] == ["s1"]
    assert p.held_by_quota == ("v2",) and p.head is None


def test_quota_counts_the_whole_nodes_a_wide_job_holds():
    p = plan("fifo", [], [job("w", slots=5, team="vision")], quotas={"vision": 6})
    assert p.starts == () and p.held_by_quota == ("w",)    # 5 slots on 4-GPU nodes hold 8


# ------------------------------------------------------------------ preemption

def test_an_urgent_job_preempts_the_lower_class_job_that_loses_least_work_and_only_that_one():
    # Checkpoints every 60 s. At 100: a (4 GPUs) ran 100 s -> 40 s at risk; b (2 GPUs) 70 s -> 10 at risk;
    # c (2 GPUs) ran 90 s -> 30 at risk. Lost GPU-seconds: a 160, b 20, c 60. An urgent 2-GPU job needs
    # one node's 2 GPUs: b alone frees them.
    running = [run(job("a", slots=4, ckpt=60), 0.0, (0,)), run(job("b", slots=2, ckpt=60), 30.0, (1,)),
               run(job("c", slots=2, ckpt=60), 10.0, (1,))]
    p = plan("fifo+preempt", running, [job("u", slots=2, cls="urgent", submit=99)])
    assert p.preempted == ("b",)
    assert [(s.job_id, s.nodes, s.how) for s in p.starts] == [("u", (1,), How.PREEMPTION)]


def test_the_restart_cost_counts_as_lost_work_when_choosing_victims():
    # Checkpoints every 10 s. At 90 s: wide (4 GPUs) has 1 s at risk = 4 GPU-s, narrow (1 GPU) 3 s = 3 GPU-s.
    running = [run(job("wide", slots=4, ckpt=10), 89.0, (0,)), run(job("narrow", slots=1, ckpt=10), 87.0, (1,)),
               run(job("rest", slots=3), 0.0, (1,))]
    u = job("u", slots=1, cls="urgent")
    assert [v.job_id for v in choose_victims(u, 90.0, [0, 0], running, 4, CLASSES)] == ["narrow"]
    # with a 10 s resume: wide 4 * 11 = 44, narrow 1 * 13 = 13
    assert [v.job_id for v in choose_victims(u, 90.0, [0, 0], running, 4, CLASSES, 0, 10.0)] == ["narrow"]
    # and a job that just checkpointed is still not free to stop: restart cost 100 makes 'narrow' cheaper
    running[0] = run(job("wide", slots=4, ckpt=10), 80.0, (0,))   # 0 s at risk
    assert [v.job_id for v in choose_victims(u, 90.0, [0, 0], running, 4, CLASSES)] == ["wide"]
    assert [v.job_id for v in choose_victims(u, 90.0, [0, 0], running, 4, CLASSES, 0, 100.0)] == ["narrow"]


def test_only_as_many_victims_as_needed_are_preempted():
    # At 100 s, GPU-seconds at risk: s1 1, s2 2 (1 GPU each, node 1), big 40 (4 GPUs, node 0), keep 100
    # (2 GPUs, node 1). An urgent 4-GPU job needs a whole node: s1 and s2 are not enough (keep stays on
    # node 1), big frees node 0; then s1 and s2 turn out not to be needed and are spared.
    running = [run(job("s1", ckpt=100), 99.0, (1,)), run(job("s2", ckpt=100), 98.0, (1,)),
               run(job("keep", slots=2, ckpt=100), 50.0, (1,)), run(job("big", slots=4, ckpt=100), 90.0, (0,))]
    victims = choose_victims(job("u", slots=4, cls="urgent"), 100.0, [0, 0], running, 4, CLASSES)
    assert [v.job_id for v in victims] == ["big"]


def test_nothing_of_the_same_or_a_higher_class_is_preempted():
    running = [run(job("u0", slots=4, cls="urgent"), 0.0, (0,)), run(job("u1", slots=4, cls="urgent"), 0.0, (1,))]
    p = plan("fifo+preempt", running, [job("u2", slots=1, cls="urgent")])
    assert p.preempted == () and p.starts == ()


def test_a_production_job_does_not_preempt_research():
    running = [run(job("r0", slots=4), 0.0, (0,)), run(job("r1", slots=4), 0.0, (1,))]
    assert plan("fifo+preempt", running, [job("p", cls="production")]).preempted == ()


def test_preemption_is_off_unless_the_policy_says_so():
    running = [run(job("r0", slots=4), 0.0, (0,)), run(job("r1", slots=4), 0.0, (1,))]
    assert plan("priority", running, [job("u", cls="urgent")]).preempted == ()


def test_an_urgent_job_of_a_team_at_its_quota_preempts_its_own_teams_research_job():
    running = [run(job("mine", slots=2, team="vision"), 0.0, (0,)), run(job("other", slots=1, team="speech"), 0.0, (1,))]
    p = plan("priority+preempt", running, [job("u", slots=2, team="vision", cls="urgent")], quotas={"vision": 2})
    assert p.preempted == ("mine",)
    assert [s.job_id for s in p.starts] == ["u"]


def test_a_job_that_can_never_fit_is_refused_with_the_reason():
    pools = {"p": POOL}
    assert "9 GPUs (held as 12: whole nodes) do not fit pool 'p', which has 8 (2 nodes x 4)" in never_fits(job("w", slots=9), pools, CLASSES, {})
    assert "quota of team 'v' on 'p' (4)" in never_fits(job("w", slots=5, team="v"), pools, CLASSES, {"v": {"p": 4}})
    assert "not a priority class" in never_fits(job("w", cls="vip"), pools, CLASSES, {})
    assert never_fits(job("w", slots=8), pools, CLASSES, {}) is None
