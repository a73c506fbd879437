"""A stop the supervisor asked for (a budget's pause, a cancel) that reaches a rank still starting up,
before its SIGTERM handler can write an emergency checkpoint, ends the rank by that signal: the launch
was stopped, not lost, and its error does not claim a checkpoint it did not write."""

from __future__ import annotations

from traingate.job.vocab import Cause
from traingate.supervision.causes import NOT_CHECKPOINTED, Evidence, classify

SUMMARY = ["Root Cause (first observed failure):", "  exitcode  : -15 (pid: 4242)"]


def test_the_supervisors_own_sigterm_during_start_up_is_a_preemption_without_a_checkpoint_not_a_lost_worker():
    verdict = classify(Evidence(returncode=1, log_tail=SUMMARY, stop_requested=True, world_size=1))
    assert verdict.cause == Cause.PREEMPTED and verdict.detail.startswith(NOT_CHECKPOINTED), verdict
    assert verdict.not_checkpointed
    assert "signal 15 (SIGTERM)" in verdict.detail
    # Its SIGKILL after the grace is the stop's as well.
    assert classify(Evidence(returncode=-9, stop_requested=True, world_size=1)).cause == Cause.PREEMPTED


def test_a_rank_killed_by_a_signal_nobody_in_the_supervisor_sent_is_still_a_lost_worker():
    assert classify(Evidence(returncode=1, log_tail=SUMMARY, world_size=1)).cause == Cause.WORKER_LOST
    # During a stop, a signal the stop does not send (a segfault) is a fault of its own.
    segv = ["Root Cause (first observed failure):", "  exitcode  : -11 (pid: 4242)"]
    assert classify(Evidence(returncode=1, log_tail=segv, stop_requested=True, world_size=1)).cause == (
        Cause.WORKER_LOST
    )
