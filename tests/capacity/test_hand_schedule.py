"""The simulator reproduces a schedule computed by hand, for a 10-job trace, exactly.

Pool: 2 nodes x 4 GPUs. Checkpoints every 20 s, resume costs 5 s, a preemptor pays 2 s of grace.
Every job carries its estimate; E's (30 s) is wrong, it runs 90 s.
"""
from __future__ import annotations

import pytest

from traingate.capacity.pools import parse_config
from traingate.capacity.policy import Policy
from traingate.capacity.simulate import simulate, summarize
from traingate.capacity.trace import read_trace

CONFIG = {
    "pools": {"p": {"gpus_per_node": 4, "nodes": 2, "price_per_gpu_hour": 1.0, "worker": "process"}},
    "scheduling": {"half_life_h": 1},
    "simulator": {"checkpoint_every_s": 20, "restart_cost_s": 5, "preempt_grace_s": 2},
}

TRACE = """\
job_id,submit_s,duration_s,gpus,team,priority,est_duration_s
A,0,100,4,a,research,100
B,2,60,4,b,research,60
C,5,50,8,a,production,50
D,6,20,2,b,research,20
E,7,90,2,a,research,30
F,30,10,4,b,urgent,10
G,40,15,1,a,research,15
H,41,15,1,b,research,15
I,45,200,4,b,research,200
J,50,5,1,a,production,5
"""


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "hand.csv"
    path.write_text(TRACE)
    return read_trace(path, parse_config(CONFIG))


def _schedule(res):
    return {r.job_id: ([a[0] for a in r.attempts], r.preempted_at, r.end_s) for r in res.records}


def test_fifo_replays_the_hand_computed_schedule(trace):
    # Strict submission order, classes ignored, no backfill, no preemption.
    #  0: A -> node 0 (best fit; a tie goes to the lowest node). 2: B -> node 1. Pool full.
    #  5: C needs both nodes whole: it is the head and blocks D..J behind it.
    # 62: B ends, node 1 free: C still needs node 0. 100: A ends: C starts on nodes 0+1, ends 150.
    # 150: D -> node 0 (4 free: best fit; ends 170), E -> node 0 (2 left; ends 240), F -> node 1 (ends 160),
    #      G (1 GPU) has no room: head.
    # 160: F ends: G, H -> node 1 (both end 175); I needs 4 on one node: head.
    # 170: D ends: 2 + 2 free on two nodes, I still cannot start (fragmentation).
    # 175: G and H end: node 1 whole -> I (ends 375); J -> node 0 (ends 180).
    expected = {
        "A": ([0], [], 100), "B": ([2], [], 62), "C": ([100], [], 150), "D": ([150], [], 170),
        "E": ([150], [], 240), "F": ([150], [], 160), "G": ([160], [], 175), "H": ([160], [], 175),
        "I": ([175], [], 375), "J": ([175], [], 180),
    }
    res = simulate(trace, parse_config(CONFIG), Policy.parse("fifo"))
    assert _schedule(res) == expected
    # While jobs arrive (0..50 s): 4 GPUs busy for 2 s, then all 8: (4*2 + 8*48) / (8*50).
    assert summarize(res).utilisation == pytest.approx(392 / 400)


def test_fair_share_backfill_preemption_replays_the_hand_computed_schedule(trace):
    # Classes first (urgent > production > research); within a class the team with fewer decayed
    # GPU-hours; EASY backfill on the estimates; urgent jobs preempt the cheapest research job.
    #  0: A -> node 0 (ends 100). 2: B -> node 1 (ends 62).
    #  5: C (production, 2 whole nodes) is the head; reserved at 100 (B's end frees one node, A's the other).
    #  6, 7: D, E cannot fit anywhere.
    # 30: F (urgent, 4 GPUs) preempts. At risk: A 30 s of work % 20 = 10 s, B 28 % 20 = 8 s;
    #     cost = 4 GPUs x (at risk + 5 s resume): A 60, B 52 -> B is the victim, only B.
    #     F on node 1 with 2 s grace: ends 30 + 2 + 10 = 42. B keeps 20 s of work, loses 8.
    # 42: F ends, node 1 free. C (head) is reserved at 100 (A's end). Team b has used fewer GPU-hours
    #     (4 GPUs since 2 s vs team a's 4 since 0), so b's jobs come first: B needs 5 + (60 - 20) = 45 s,
    #     ends 87 <= 100 -> B is backfilled on node 1 (ends 87). Nothing else fits.
    # 50: J (production, 1 GPU) arrives: no room.
    # 87: B ends, node 1 free. C is still waiting for node 0 (reserved at 100). J: 87 + 5 = 92 <= 100 ->
    #     backfilled on node 1. D would end 107, H 102, G 102, E 117: all after 100, refused.
    # 92: J ends. 100: A ends: C starts on nodes 0+1, ends 150.
    # 150: team b is far below team a now (C held 8 GPUs): D -> node 0 (ends 170), H -> node 0 (ends 165),
    #      I -> node 1 (ends 350). E (a, 2 GPUs) has no room: head, reserved at 165 (H's end).
    #      G: 150 + 15 = 165 <= 165 -> backfilled into node 0's last GPU (ends 165).
    # 165: G and H end: E -> node 0, runs its true 90 s (its estimate said 30): ends 255.
    expected = {
        "A": ([0], [], 100), "B": ([2, 42], [30], 87), "C": ([100], [], 150), "D": ([150], [], 170),
        "E": ([165], [], 255), "F": ([30], [], 42), "G": ([150], [], 165), "H": ([150], [], 165),
        "I": ([150], [], 350), "J": ([87], [], 92),
    }
    res = simulate(trace, parse_config(CONFIG), Policy.parse("fairshare+backfill+preempt"))
    assert _schedule(res) == expected
    how = {r.job_id: [a[2] for a in r.attempts] for r in res.records}
    assert how["F"] == ["preemption"]
    assert how["B"] == ["in order", "backfill"]
    assert how["J"] == how["G"] == ["backfill"]
    # GPU-seconds held but not useful: B's 8 s lost + 5 s resume on 4 GPUs, F's 2 s grace on 4 GPUs.
    assert summarize(res).wasted_gpu_h == pytest.approx(4 * (8 + 5 + 2) / 3600)
