"""The supervision policy as plain functions: no processes, no Prefect."""
from __future__ import annotations

import errno
import random

import pytest
import torch

from traingate.runtime import failures, inject
from traingate.job.files import Heartbeat, LastWords
from traingate.supervision import causes


def _hb(rank, d):
    return Heartbeat(rank=rank, step=d["step"], time=d.get("time", 0.0), pid=d.get("pid", 0),
                     phase=d.get("phase", "train"))


def _lw(words):
    return [LastWords(rank=w.get("rank", 0), cause=w["cause"], error=w["error"], time=w.get("time", 0.0),
                      exit_code=w.get("exit_code", 1)) for w in words]
from traingate.supervision.backoff import Backoff, RetryBudget
from traingate.supervision.causes import Evidence, classify
from traingate.supervision.heartbeat import HangDetector, checkpoint_stale, hang_timeout
from traingate.supervision.oom import smaller_micro_batch

TORCHRUN_SIGKILL_SUMMARY = """
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 7767)  (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 7767
""".splitlines()


@pytest.mark.parametrize("evidence, cause, retryable", [
    (Evidence(returncode=75, result_status="preempted"), "preempted", True),
    (Evidence(returncode=1, log_tail=TORCHRUN_SIGKILL_SUMMARY), "worker_lost", True),
    (Evidence(returncode=-9), "worker_lost", True),
    (Evidence(returncode=-9, hang_detected=True), "hang", True),
    (Evidence(returncode=1, last_words=_lw([{"cause": "collective_timeout", "error": "x", "time": 2.0},
                                        {"cause": "worker_lost", "error": "peer closed", "time": 1.0}])),
     "collective_timeout", True),
    (Evidence(returncode=77, last_words=_lw([{"cause": "transient_io", "error": "EIO"}])), "transient_io", True),
    (Evidence(returncode=77, last_words=_lw([{"cause": "checkpoint_error", "error": "ENOSPC"}])), "transient_io", True),
    (Evidence(returncode=1, last_words=_lw([{"cause": "oom", "error": "CUDA out of memory"}])), "oom", False),
    (Evidence(returncode=76, result_status="diverged"), "diverged", False),
    (Evidence(returncode=64, last_words=_lw([{"cause": "user_error", "error": "KeyError"}])), "user_error", False),
    (Evidence(returncode=64), "user_error", False),
])
def test_exit_evidence_is_classified_into_cause_and_retryability(evidence, cause, retryable):
    verdict = classify(evidence)
    assert (verdict.cause, verdict.retryable) == (cause, retryable)


def test_torchruns_root_cause_names_the_signal_not_the_ranks_it_terminated_afterwards():
    tail = ["Failures:", "  exitcode  : -15 (pid: 1)  (SIGTERM)", *TORCHRUN_SIGKILL_SUMMARY]
    assert "signal 9" in classify(Evidence(returncode=1, log_tail=tail)).detail


def test_a_rank_that_reported_its_error_is_not_blamed_on_a_hang():
    words = _lw([{"cause": "collective_timeout", "error": "Timed out", "time": 1.0}])
    assert classify(Evidence(returncode=-9, last_words=words, hang_detected=True)).cause == "collective_timeout"


def test_a_completed_run_has_no_cause():
    assert classify(Evidence(returncode=0, result_status="completed")).completed


def test_oom_is_retryable_only_under_the_oom_policy():
    ev = Evidence(returncode=1, last_words=_lw([{"cause": "oom", "error": "OOM"}]))
    assert not classify(ev).retryable
    assert classify(ev, oom_retry=True).retryable


def test_the_root_cause_beats_a_peers_echo_of_it():
    words = _lw([{"cause": "worker_lost", "error": "Connection closed by peer", "time": 1.0},
             {"cause": "user_error", "error": "KeyError: 'x'", "time": 5.0}])
    assert classify(Evidence(returncode=1, last_words=words)).cause == "user_error"


@pytest.mark.parametrize("exc, cause", [
    (torch.OutOfMemoryError("CUDA out of memory"), "oom"),
    (MemoryError(), "oom"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1000ms "
                  "for recv operation to complete"), "collective_timeout"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"), "worker_lost"),
    (torch.distributed.DistBackendError("NCCL watchdog caught collective operation timeout"), "collective_timeout"),
    (ConnectionResetError("reset"), "transient_io"),
    (OSError(errno.EIO, "I/O error"), "transient_io"),
    (FileNotFoundError(errno.ENOENT, "no such file"), "user_error"),
    (KeyError("label"), "user_error"),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "user_error"),
])
def test_a_caught_exception_names_its_cause(exc, cause):
    assert failures.cause_of_exception(exc) == cause


def test_backoff_grows_exponentially_caps_and_jitters_downwards_only():
    b = Backoff(base_s=1.0, factor=2.0, max_s=10.0, jitter=0.5)
    rng = random.Random(0)
    for n, full in enumerate([1.0, 2.0, 4.0, 8.0, 10.0, 10.0]):
        delays = [b.delay(n, rng) for _ in range(50)]
        assert all(full * 0.5 <= d <= full for d in delays)
        assert len(set(delays)) > 1  # jittered: restarted jobs do not stampede together


def test_retry_budget_stops_on_count_and_on_wall_clock():
    count = RetryBudget(max_restarts=2, max_downtime_s=1e9)
    count.charge(1.0)
    assert count.allows(1.0)
    count.charge(1.0)
    assert not count.allows(1.0) and "max_restarts" in count.why_not()
    clock = RetryBudget(max_restarts=100, max_downtime_s=10.0)
    clock.charge(8.0)
    assert not clock.allows(5.0) and "max_downtime_s" in clock.why_not(5.0)


def test_hang_timeout_defaults_to_twice_the_canary_p99_with_a_floor():
    assert hang_timeout(canary_p99_s=50.0, floor_s=60.0) == 100.0
    assert hang_timeout(canary_p99_s=0.01, floor_s=60.0) == 60.0
    assert hang_timeout(canary_p99_s=None, floor_s=60.0) == 60.0


def test_hang_detector_flags_a_rank_whose_step_stopped_advancing():
    d = HangDetector(timeout_s=5.0, startup_timeout_s=100.0, world_size=2, launched_at=0.0)
    d.observe({0: _hb(0, {"step": 1, "time": 1.0}), 1: _hb(1, {"step": 1, "time": 1.0})}, now=1.0)
    d.observe({0: _hb(0, {"step": 2, "time": 4.0}), 1: _hb(1, {"step": 1, "time": 1.0})}, now=4.0)
    assert d.stalled(now=5.5) is None
    assert "rank 1 stuck at step 1" in d.stalled(now=6.5)


def test_hang_detector_flags_a_rank_that_never_started():
    d = HangDetector(timeout_s=5.0, startup_timeout_s=30.0, world_size=2, launched_at=0.0)
    d.observe({0: _hb(0, {"step": 0, "time": 10.0})}, now=10.0)
    assert d.stalled(now=20.0) is None
    assert "[1]" in d.stalled(now=31.0)


def test_checkpoint_staleness_alerts_after_twice_the_interval():
    assert checkpoint_stale(100, 50, 25, 1.0, None) is None
    assert checkpoint_stale(101, 50, 25, 1.0, None) is not None
    assert checkpoint_stale(10, 10, None, 119.0, 60.0) is None
    assert checkpoint_stale(10, 10, None, 121.0, 60.0) is not None


def test_oom_policy_halves_micro_batch_and_doubles_accumulation_keeping_global_batch():
    assert smaller_micro_batch(32, 2) == (16, 4)
    b, a = smaller_micro_batch(16, 1)
    assert b * a == 16
    assert smaller_micro_batch(1, 8) is None and smaller_micro_batch(7, 1) is None


def test_fault_plans_parse_and_reject_typos():
    assert [f.token for f in inject.parse("kill@7:1,io@10")] == ["kill@7:1", "io@10"]
    with pytest.raises(ValueError, match="kind@step"):
        inject.parse("kil@7")


def test_injected_faults_fire_once_per_stage_directory(tmp_path):
    faults = inject.parse("error@3:0")
    with pytest.raises(RuntimeError, match="injected"):
        inject.Injector(faults, 0, tmp_path / "faults").before_step(3, None)
    inject.Injector(faults, 0, tmp_path / "faults").before_step(3, None)  # a relaunch: no second time
    inject.Injector(faults, 1, tmp_path / "faults").before_step(3, None)  # another rank: not targeted
    assert [(m["fault"], m["rank"], m["step"]) for m in inject.fired(tmp_path)] == [("error@3:0", 0, 3)]


def test_hang_detector_gives_the_work_after_the_last_step_the_longer_startup_timeout():
    d = HangDetector(timeout_s=5.0, startup_timeout_s=60.0, world_size=1, launched_at=0.0, final_step=16)
    d.observe({0: _hb(0, {"step": 16, "time": 1.0})}, now=1.0)
    assert d.stalled(now=30.0) is None  # final checkpoint + evaluation, not a hang
    assert "finishing" in d.stalled(now=62.0)


def test_hang_detector_does_not_call_a_rank_that_already_exited_hung():
    d = HangDetector(timeout_s=5.0, startup_timeout_s=60.0, world_size=2, launched_at=0.0, final_step=16)
    d.observe({0: _hb(0, {"step": 7, "time": 1.0}), 1: _hb(1, {"step": 7, "time": 1.0})}, now=1.0, exited={1})
    assert "rank 0 stuck" in d.stalled(now=7.0)
    d.observe({}, now=7.0, exited={0})
    assert d.stalled(now=30.0) is None


def test_hang_detector_allows_a_rank_that_is_writing_its_emergency_checkpoint_to_be_slow():
    d = HangDetector(timeout_s=5.0, startup_timeout_s=60.0, world_size=1, launched_at=0.0, final_step=16)
    d.observe({0: _hb(0, {"step": 4, "time": 1.0, "phase": "preempting"})}, now=1.0)
    assert d.stalled(now=30.0) is None
