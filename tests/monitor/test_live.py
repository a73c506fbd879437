"""The supervisor's monitor over stage files as the runtime writes them (metrics.jsonl through the
runtime's own MetricsWriter, heartbeats, progress.jsonl): what it alerts on, once, and what a
roll-back makes it forget."""
from __future__ import annotations

import math

from traingate.job import files
from traingate.cost.charged import run_usd
from traingate.monitor.live import StageMonitor
from traingate.alerts.rules import Action, AlertsSpec, Rule


def _steps(stage_dir, losses, attempt=0, first=1, t0=1000.0, step_time=0.1, data_wait=0.001):
    w = files.MetricsWriter(stage_dir, flush_s=0)
    for i, loss in enumerate(losses):
        s = first + i
        w.write(files.StepMetrics(s, t0 + s * step_time, loss, 1.0, 0.01, step_time, data_wait, attempt))
    w.close()


def _monitor(tmp_path, **kw) -> StageMonitor:
    return StageMonitor(AlertsSpec(**kw), tmp_path, slots=8, price_per_slot_hour=2.5)


def _decay(n, start=1):
    return [2.0 / math.sqrt(s) for s in range(start, start + n)]


SPIKE = [5.0, 5.2, 4.9, 5.1, 5.0, 4.8]  # six steps up: the default rule looks at the median of the latest 6


def test_a_healthy_curve_raises_nothing_and_a_spike_raises_one_roll_back_once(tmp_path):
    m = _monitor(tmp_path)
    _steps(tmp_path, _decay(60))
    assert m.poll(now=2000.0, held_s=10) == []
    _steps(tmp_path, SPIKE, first=61)
    [f] = m.poll(now=2001.0, held_s=11)
    assert (f.rule, f.action, f.at) == (Rule.LOSS_SPIKE, Action.ROLLBACK, 61)
    _steps(tmp_path, _decay(5, 67), first=67)
    assert m.poll(now=2002.0, held_s=12) == []  # the same spike is not news


def test_polls_closer_than_every_s_do_not_evaluate(tmp_path):
    m = _monitor(tmp_path, every_s=5)
    _steps(tmp_path, _decay(60))
    assert m.poll(now=100.0, held_s=1) == []
    _steps(tmp_path, SPIKE, first=61)
    assert m.poll(now=102.0, held_s=3) == []
    assert [f.rule for f in m.poll(now=105.0, held_s=6)] == [Rule.LOSS_SPIKE]


def test_the_steps_after_a_spike_still_high_against_its_baseline_are_not_each_a_new_alert(tmp_path):
    m = _monitor(tmp_path)
    _steps(tmp_path, _decay(60) + SPIKE)
    assert [f.at for f in m.poll(now=1.0, held_s=1)] == [61]
    _steps(tmp_path, [4.8, 4.9, 4.7], first=67)
    assert m.poll(now=2.0, held_s=2) == []


def test_after_a_roll_back_the_rolled_back_steps_are_forgotten_and_a_new_spike_at_the_same_step_is_news(tmp_path):
    m = _monitor(tmp_path)
    _steps(tmp_path, _decay(60) + SPIKE)
    [first] = m.poll(now=10.0, held_s=1)
    _steps(tmp_path, [6.0, 6.5], first=67)  # the rolled-back attempt's last lines, read after the roll-back
    m.rewind(to_step=50, next_attempt=1)
    assert max(x for x, _ in m.loss) == 50
    _steps(tmp_path, _decay(10, 51), attempt=1, first=51)
    assert m.poll(now=20.0, held_s=2) == []
    _steps(tmp_path, SPIKE, attempt=1, first=61)
    [again] = m.poll(now=30.0, held_s=3)
    assert (again.rule, again.at) == (first.rule, first.at)


def test_an_event_already_in_alerts_jsonl_is_not_raised_again_by_a_later_supervision(tmp_path):
    _steps(tmp_path, _decay(60) + SPIKE)
    [f] = _monitor(tmp_path).poll(now=10.0, held_s=1)
    files.append_alert(tmp_path, files.AlertRecord(time=10.0, stage="full", rule=str(f.rule), severity="critical",
                                                   action="pause", at=f.at, message=f.message))
    assert _monitor(tmp_path).poll(now=20.0, held_s=1) == []


def test_a_condition_is_raised_when_it_starts_and_again_only_after_it_stopped(tmp_path):
    spec = AlertsSpec(step_time_regression={"skip": 0, "baseline": 10, "recent": 10})
    m = StageMonitor(spec, tmp_path, slots=1, price_per_slot_hour=1.0)
    _steps(tmp_path, _decay(20), step_time=0.1)
    assert m.poll(now=1.0, held_s=1) == []
    _steps(tmp_path, _decay(10, 21), first=21, step_time=0.2)
    assert [f.rule for f in m.poll(now=2.0, held_s=2)] == [Rule.STEP_TIME_REGRESSION]
    _steps(tmp_path, _decay(5, 31), first=31, step_time=0.2)
    assert m.poll(now=3.0, held_s=3) == []        # still slow: already raised
    _steps(tmp_path, _decay(10, 36), first=36, step_time=0.1)
    assert m.poll(now=4.0, held_s=4) == []        # back to normal: cleared
    _steps(tmp_path, _decay(10, 46), first=46, step_time=0.3)
    assert [f.rule for f in m.poll(now=5.0, held_s=5)] == [Rule.STEP_TIME_REGRESSION]


def test_spend_is_what_was_spent_before_plus_held_time_at_the_slots_price(tmp_path):
    m = StageMonitor(AlertsSpec(), tmp_path, slots=8, price_per_slot_hour=2.5, budget_usd=100.0,
                     spent_before_usd=70.0)
    # 8 slots x $2.50 = $20 an hour: 70 + 20 x 0.5 h = 80 (warning), then 70 + 20 x 1.5 h = 100 (exhausted)
    assert [f.rule for f in m.poll(now=1.0, held_s=1799.0)] == []
    assert [f.rule for f in m.poll(now=2.0, held_s=1800.0)] == [Rule.BUDGET_WARNING]
    [f] = m.poll(now=3.0, held_s=5400.0)
    assert (f.rule, f.action, f.values["spent_usd"]) == (Rule.BUDGET_EXHAUSTED, Action.PAUSE, 100.0)


def test_per_rank_busy_times_from_heartbeats_find_the_straggler(tmp_path):
    m = _monitor(tmp_path, straggler={"window": 20})
    for tick in range(4):
        steps = range(tick * 8 + 1, tick * 8 + 17)  # each heartbeat carries the last 16 steps
        beats = {r: files.Heartbeat(rank=r, step=steps[-1], time=float(tick), pid=1,
                                    recent=[[s, 0.05 if r == 0 else 0.25] for s in steps]) for r in (0, 1)}
        m.observe(beats, now=float(tick))
    [f] = m.poll(now=10.0, held_s=1)
    assert (f.rule, f.action, f.values["rank"]) == (Rule.STRAGGLER, Action.QUARANTINE, 1)


def test_gpu_utilisation_logged_by_the_runtime_feeds_the_idle_gpu_rule(tmp_path):
    m = _monitor(tmp_path)
    w = files.MetricsWriter(tmp_path, flush_s=0)
    for i in range(700):  # 700 s at 30% utilisation, one logging step a second
        w.write(files.StepMetrics(i + 1, 1000.0 + i, 1.0, 1.0, 0.01, 0.1, 0.0, gpu_util_percent=30.0))
    w.close()
    [f] = [f for f in m.poll(now=1700.0, held_s=1) if f.rule == Rule.GPU_UNDERUTILISED]
    assert f.action == Action.NOTIFY


def test_run_spend_adds_up_every_attempt_and_backoff_of_every_stage(tmp_path):
    for stage, slots, attempts in (("canary", 2, [(0, 100, 5)]), ("full", 8, [(0, 3600, 60), (3660, 7200, 0)])):
        d = tmp_path / stage
        d.mkdir()
        files.write_json(d / files.JOB, {"slots": slots, "price_per_slot_hour": 2.0})
        files.write_supervisor_state(d, files.SupervisorState(attempts=[
            {"launched_at": a, "ended_at": b, "backoff_s": c} for a, b, c in attempts]))
    # canary: 105 s x 2 slots x $2/h; full: (3600 + 60 + 3540) s x 8 x $2/h
    expect = 105 * 2 * 2 / 3600 + 7200 * 8 * 2 / 3600
    assert math.isclose(run_usd(tmp_path), expect)
    assert math.isclose(run_usd(tmp_path, but="full"), 105 * 2 * 2 / 3600)
