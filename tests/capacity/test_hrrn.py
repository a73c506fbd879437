"""The ``hrrn`` order: highest response ratio next on the predicted size (wait over predicted remaining
GPU-seconds, capped), classes and teams ignored but for preemption."""
from __future__ import annotations

import pytest

from traingate.capacity.jobs import Job, started
from traingate.capacity.policy import (
    HRRN_CAP_GPU_S,
    HRRN_FLOOR_GPU_S,
    How,
    Order,
    Policy,
    Rules,
    queue_order,
    response_ratio,
    schedule,
)
from traingate.capacity.pools import CapacityError, PoolConfig, _default_classes

CLASSES = _default_classes()
POOL = PoolConfig(gpus_per_node=8, nodes=1, price_per_gpu_hour=1.0, worker="process")
H = 3600.0
HRRN = Policy.parse("hrrn+backfill+preempt")


def job(jid, slots=1, submit=0.0, cls="research", est=None, team="t"):
    return Job(jid, team, cls, "p", slots, submit, est_duration_s=est)


def est(j):
    return j.est_duration_s


def order(waiting, now):
    return [j.job_id for j in queue_order(waiting, HRRN, CLASSES, {}, est, now=now)]


def test_a_small_job_that_arrived_after_a_large_one_goes_first_while_the_large_one_has_not_waited_long():
    large = job("large", slots=8, submit=0.0, est=2 * H)  # 16 GPU-h, counted as the 4 GPU-h cap
    small = job("small", slots=1, submit=600.0, est=600.0)  # 600 GPU-s
    # At 20 min: large 1200 / (14400 + 480) = 0.08, small 600 / (600 + 480) = 0.56.
    assert order([large, small], now=1200.0) == ["small", "large"]
    # The pass starts the small one on the free GPU and the large one, first in submission order, waits.
    busy = started(job("busy", slots=1, est=10 * H), 0.0, (0,))
    plan = schedule(1200.0, POOL, [busy], [large, small], Rules(HRRN, CLASSES, {}), {}, est)
    assert [(s.job_id, s.how) for s in plan.starts] == [("small", How.IN_ORDER)] and plan.head == "large"


def test_the_large_jobs_ratio_rises_with_its_wait_until_it_goes_ahead_of_newer_small_arrivals():
    large = job("large", slots=8, submit=0.0, est=2 * H)
    ratios = [response_ratio(large, t, est) for t in (0.0, H, 10 * H, 1000 * H)]
    assert ratios == sorted(ratios) and ratios[0] == 0.0 and ratios[-1] > 200  # grows without bound
    # A small job that arrived 5 minutes ago has ratio 300 / 1080 = 0.28: ahead of the large one at 30 min
    # (1800 / 14880 = 0.12), behind it at 2 h (7200 / 14880 = 0.48). The large one starves behind no stream.
    for now, first in ((1800.0, "fresh"), (2 * H, "large")):
        fresh = job("fresh", slots=1, submit=now - 300.0, est=600.0)
        assert order([large, fresh], now)[0] == first, now
    # As the head it keeps the GPUs it waits for: the fresh arrival, predicted to end after the running
    # job frees the node, is not backfilled.
    busy = started(job("busy", slots=1, est=3 * H), 0.0, (0,))
    fresh = job("fresh", slots=1, submit=2 * H - 300.0, est=2 * H)
    plan = schedule(2 * H, POOL, [busy], [fresh, large], Rules(HRRN, CLASSES, {}), {}, est)
    assert plan.head == "large" and plan.reserved_s == 3 * H and plan.starts == ()


def test_classes_do_not_order_the_queue_but_an_urgent_job_still_preempts_a_research_one():
    now = 2 * H
    urgent = job("urgent", slots=4, submit=now - 60.0, cls="urgent", est=H)  # 60 / 14880
    old = job("old", slots=4, submit=0.0, est=H)  # research, 7200 / 14880: first in order
    assert order([urgent, old], now) == ["old", "urgent"]
    running = [started(job("r1", slots=4, est=10 * H), 0.0, (0,)), started(job("r2", slots=4, est=10 * H), 0.0, (0,))]
    plan = schedule(now, POOL, running, [urgent, old], Rules(HRRN, CLASSES, {}), {}, est)
    assert [(s.job_id, s.how) for s in plan.starts] == [("urgent", How.PREEMPTION)]
    assert len(plan.preempted) == 1 and plan.head == "old"
    # Without +preempt nothing is stopped; a research job never preempts.
    calm = schedule(now, POOL, running, [urgent, old], Rules(Policy.parse("hrrn+backfill"), CLASSES, {}), {}, est)
    assert calm.starts == () and calm.preempted == ()
    alone = schedule(now, POOL, running, [old], Rules(HRRN, CLASSES, {}), {}, est)
    assert alone.starts == () and alone.preempted == ()


def test_a_job_without_a_prediction_ranks_as_one_predicted_at_the_cap():
    unknown = job("unknown", slots=2, submit=0.0)
    at_cap = job("at_cap", slots=2, submit=0.0, est=HRRN_CAP_GPU_S / 2)
    above = job("above", slots=8, submit=0.0, est=10 * H)  # capped
    below = job("below", slots=2, submit=0.0, est=HRRN_CAP_GPU_S / 2 - 600.0)
    now = 5 * H
    assert response_ratio(unknown, now, est) == response_ratio(at_cap, now, est) == response_ratio(above, now, est)
    assert response_ratio(unknown, now, est) == now / (HRRN_CAP_GPU_S + HRRN_FLOOR_GPU_S)
    # Ties go by submission, then id: the unknown job stands among the capped ones, behind a smaller one.
    assert order([unknown, above, below, at_cap], now) == ["below", "above", "at_cap", "unknown"]


def test_a_resumed_job_ranks_on_its_remaining_work():
    fresh = job("fresh", slots=4, submit=0.0, est=H)  # 4 GPU-h: the cap
    resumed = Job("resumed", "t", "research", "p", 4, 0.0, est_duration_s=H, done_s=0.75 * H)  # 1 GPU-h left
    assert order([fresh, resumed], now=H) == ["resumed", "fresh"]
    assert response_ratio(resumed, H, est) == H / (4 * 0.25 * H + HRRN_FLOOR_GPU_S)


def test_hrrn_with_aged_is_refused_in_one_line_that_says_why():
    with pytest.raises(CapacityError) as err:
        Policy.parse("hrrn+aged+backfill")
    assert str(err.value) == "policy 'hrrn+aged+backfill': hrrn ages by its response ratio; drop +aged"
    assert Policy.parse("hrrn+backfill+preempt") == Policy(Order.HRRN, backfill=True, preempt=True)
    assert Policy.parse("hrrn+preempt+backfill").name == "hrrn+backfill+preempt"
