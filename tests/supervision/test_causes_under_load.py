"""A lost worker is `worker_lost` and a preemption `preempted` whichever signal a rank sees first: the
evidence is which ranks left last words, not the order of events, which a loaded machine shuffles."""

from __future__ import annotations

import subprocess
import sys

import pytest

from traingate.job.files import LastWords
from traingate.job.vocab import Cause
from traingate.supervision import causes
from traingate.supervision.causes import Evidence, classify

HOGS = 3


def _words(*ranks_causes: tuple[int, str]) -> list[LastWords]:
    return [LastWords(rank, cause, f"rank {rank} {cause}", 1.0 + rank, 75) for rank, cause in ranks_causes]


def test_a_peer_that_took_torchruns_sigterm_before_noticing_the_lost_rank_does_not_make_it_a_preemption():
    # Rank 1 was SIGKILLed and said nothing; rank 0 got torchrun's SIGTERM first and said "preempted".
    verdict = classify(Evidence(returncode=1, last_words=_words((0, "preempted")), world_size=2))
    assert verdict.cause == Cause.WORKER_LOST and "rank 1 ended without last words" in verdict.detail
    assert causes.restarted_in_place(_words((0, "preempted")), 2)[0] == Cause.WORKER_LOST


def test_a_preemption_every_rank_reports_stays_a_preemption():
    words = _words((0, "preempted"), (1, "preempted"))
    assert classify(Evidence(returncode=75, result_status="preempted", last_words=words, world_size=2)).cause == (
        Cause.PREEMPTED
    )
    # A stop the supervisor asked for is a preemption even if a rank died before its last words.
    ev = Evidence(returncode=75, last_words=_words((0, "preempted")), stop_requested=True, world_size=2)
    assert classify(ev).cause == Cause.PREEMPTED


@pytest.fixture
def cpu_hogs():
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    yield
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("fault, cause", [("kill@7:1", Cause.WORKER_LOST), ("term@7", Cause.PREEMPTED)])
def test_a_killed_worker_and_a_preemption_are_told_apart_beside_busy_cpu_hogs(supervised, cpu_hogs, fault, cause):
    run = supervised(fault)
    assert run.sup.status == "completed", run.sup.error
    assert run.causes == [cause, None], [(a.cause, a.detail) for a in run.sup.attempts]


def test_a_drill_charges_a_fault_to_the_launch_that_trained_over_its_step_not_to_the_clocks_window():
    from types import SimpleNamespace

    from traingate.supervision.drill import records
    from traingate.supervision.supervisor import Attempt

    # As recorded on a loaded box: torchrun's relaunched group was stamped (process start) 0.14 s before
    # the marker the killed rank 1 wrote just before its SIGKILL at step 23.
    attempts = [
        Attempt(0, 601.17, 611.96, cause=Cause.COLLECTIVE_TIMEOUT, start_steps={0: 8}, end_step=21),
        Attempt(1, 614.63, 623.92, cause=Cause.WORKER_LOST, start_steps={0: 20}, end_step=23),
        Attempt(2, 623.92, 636.97, cause=Cause.PREEMPTED, start_steps={0: 20}, end_step=29, first_step_time=630.0),
    ]
    fired = [{"fault": "kill@23:1", "kind": "kill", "step": 23, "rank": 1, "time": 624.06}]
    [rec] = records(SimpleNamespace(attempts=attempts), fired)
    assert rec.classified_as == Cause.WORKER_LOST and rec.steps_lost == 3
