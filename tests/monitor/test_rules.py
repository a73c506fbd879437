"""Alert rules over real and shaped metric series: each fires on the shape that triggers it, with its
action and runbook section, and stays quiet on a healthy series (one recorded from a real run)."""
from __future__ import annotations

import dataclasses
import math
import re
import statistics
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).parent))
from recorded_run import Recorded, record_run  # noqa: E402

from tgtest import ROOT  # noqa: E402
from traingate.alerts import rules
from traingate.alerts.rules import Action, AlertsSpec, Rule, Severity, Signals  # noqa: E402

SPEC = AlertsSpec()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Recorded:
    """A real 2-process digits run (140 steps, every metric logged each step, validation every 10)."""
    return record_run(tmp_path_factory.mktemp("recorded"))


def _signals(r: Recorded, **changes) -> Signals:
    m = r.metrics
    fields = dict(
        loss=m["train_loss"], val=r.val, grad_norm=m["grad_norm"], step_time=m["step_time_s"],
        data_wait=m["data_wait_s"],
        rank_step_times={0: m["system/rank0/step_time_s"], 1: m["system/rank1/step_time_s"]},
        checkpoint_times=r.checkpoint_times, started_at=r.launched_at,
        checkpoint_interval_s=rules.checkpoint_interval_s(20, None, statistics.median(v for _, v in m["step_time_s"])),
        heartbeats=r.timestamps["train_loss"], gpu_util=[], restart_times=[])
    fields.update(changes)
    return Signals(**fields)


def _end(r: Recorded) -> float:
    return max([t for t, _ in r.timestamps["train_loss"]] + r.checkpoint_times)


def _splice(series, at_step, fn):
    return [(s, fn(v) if s == at_step else v) for s, v in series]


# ---------------------------------------------------------------- the real run

@pytest.mark.long  # the module's real run
def test_no_rule_fires_on_a_real_healthy_run_read_back_from_mlflow(recorded):
    from mlflow.tracking import MlflowClient

    from traingate.monitor.signals import from_mlflow

    m = recorded.metrics
    assert len(m["train_loss"]) == 140 and len(recorded.val) == 14
    assert all(math.isfinite(v) for _, v in m["train_loss"])
    read = from_mlflow(MlflowClient(recorded.tracking_uri), recorded.run_id)
    assert (read.loss, read.val, sorted(read.rank_step_times)) == (m["train_loss"], recorded.val, [0, 1])
    assert read.gpu_util == [] and read.restart_times == [] and len(read.heartbeats) == 140
    signals = dataclasses.replace(read, checkpoint_times=recorded.checkpoint_times, started_at=recorded.launched_at,
                                  checkpoint_interval_s=_signals(recorded).checkpoint_interval_s)
    assert signals == _signals(recorded)
    fired = rules.evaluate(signals, SPEC, now=_end(recorded))
    assert fired == [], [f.message for f in fired]


def test_a_nan_spliced_into_the_real_loss_fires_nonfinite_loss_and_notifies(recorded):
    loss = _splice(recorded.metrics["train_loss"], 70, lambda v: math.nan)
    fired = rules.evaluate(_signals(recorded, loss=loss), SPEC, now=_end(recorded))
    assert [f.rule for f in fired] == [Rule.NONFINITE_LOSS]
    f = fired[0]
    # The runtime skips the non-finite update itself; the default only tells (rollback is opt-in).
    assert (f.at, f.action, f.severity) == (70, Action.NOTIFY, Severity.WARNING)
    assert "train_loss is nan at step 70 (1 non-finite of 140 points)" in f.message
    assert f.message.endswith("[notify; runbook docs/runbooks.md#nonfinite-loss]")


def test_a_spike_spliced_into_the_real_loss_fires_loss_spike_at_its_first_step(recorded):
    loss = [(s, 4.0 if s >= 100 else v) for s, v in recorded.metrics["train_loss"]]
    fired = rules.evaluate(_signals(recorded, loss=loss), SPEC, now=_end(recorded))
    assert [f.rule for f in fired] == [Rule.LOSS_SPIKE]
    f = fired[0]
    assert (f.at, f.values["decided_at"], f.action) == (100, 102, Action.ROLLBACK)
    assert f.values["value"] == 4.0 and f.values["ratio"] > SPEC.loss_spike.ratio
    assert re.search(r"train_loss from step 100: median [0-9.]+ over steps 97-102 is [0-9.]+x the median [0-9.]+ of the "
                     r"15 points before \(limit 2x\) and gives back [0-9.]+% of the fall from the start level",
                     f.message), f.message


def test_a_gradient_jump_spliced_into_the_real_run_fires_grad_norm_explosion(recorded):
    grad = _splice(recorded.metrics["grad_norm"], 90, lambda v: v * 50)
    f = rules.grad_norm_explosion(grad, SPEC.grad_norm_explosion)
    assert f is not None and f.at == 90 and f.action == Action.ROLLBACK
    assert rules.grad_norm_explosion(recorded.metrics["grad_norm"], SPEC.grad_norm_explosion) is None
    inf = _splice(recorded.metrics["grad_norm"], 30, lambda v: math.inf)
    assert rules.grad_norm_explosion(inf, SPEC.grad_norm_explosion).at == 30


def test_slowing_the_last_steps_of_the_real_run_fires_step_time_regression(recorded):
    st = recorded.metrics["step_time_s"]
    base = statistics.median(v for _, v in st[5:55])
    slow = [(s, v if s <= 90 else base * 1.5) for s, v in st]
    f = rules.step_time_regression(slow, SPEC.step_time_regression)
    assert f is not None and f.rule == Rule.STEP_TIME_REGRESSION and f.at == 91
    assert f.values["recent"] == pytest.approx(base * 1.5) and f.values["increase"] == pytest.approx(0.5)
    # 15% slower is within the 20% the rule allows.
    assert rules.step_time_regression([(s, v if s <= 90 else base * 1.15) for s, v in st],
                                      SPEC.step_time_regression) is None


def test_a_rank_made_slower_in_the_real_run_is_named_as_straggler_for_quarantine(recorded):
    m = recorded.metrics
    slow1 = [(s, v * 1.6) for s, v in m["system/rank1/step_time_s"]]
    f = rules.straggler({0: m["system/rank0/step_time_s"], 1: slow1, 2: m["system/rank0/step_time_s"]},
                        SPEC.straggler)
    assert f is not None and f.values["rank"] == 1 and f.action == Action.QUARANTINE
    assert f.message.startswith("straggler: rank 1 was more than 20% slower")
    assert rules.straggler({0: m["system/rank0/step_time_s"], 1: m["system/rank1/step_time_s"]},
                           SPEC.straggler) is None


def test_data_waits_spliced_into_the_real_run_fire_data_loader_stall(recorded):
    m = recorded.metrics
    wait = [(s, t * 0.5 if s > 90 else w) for (s, w), (_, t) in zip(m["data_wait_s"], m["step_time_s"])]
    f = rules.data_loader_stall(wait, m["step_time_s"], SPEC.data_loader_stall)
    assert f is not None and f.at == 91 and f.values["share"] == pytest.approx(0.5)
    assert rules.data_loader_stall(m["data_wait_s"], m["step_time_s"], SPEC.data_loader_stall) is None


def test_the_real_runs_checkpoints_go_stale_only_after_twice_the_interval(recorded):
    last = max(recorded.checkpoint_times)
    interval = 10.0
    args = (recorded.checkpoint_times, recorded.launched_at, interval, SPEC.checkpoint_stale)
    assert rules.checkpoint_stale(*args, now=last + 19.0) is None
    f = rules.checkpoint_stale(*args, now=last + 21.0)
    assert f is not None and f.at == last and f.values["age_s"] == pytest.approx(21.0)
    assert "21 s since the last checkpoint; expected one every 10 s (limit 2x = 20 s)" in f.message


def test_real_validation_that_stops_improving_fires_after_patience(recorded):
    val = list(recorded.val)
    best = min(v for _, v in val)
    assert rules.val_not_improved(val, SPEC.val_not_improved) is None
    worse = val + [(150 + 10 * i, best + 0.05) for i in range(3)]
    f = rules.val_not_improved(worse, SPEC.val_not_improved)
    assert f is not None and f.values["best"] == best and f.values["evaluations"] == 5


def test_a_restarted_run_replaying_the_same_steps_fires_no_progress(recorded):
    beats = list(recorded.timestamps["train_loss"])
    t_end, high = beats[-1]
    # After the run's last step it restarts from step 120 again and again, beating every 10 s for 20 min.
    replay = [(t_end + 10 * i, 120 + (i % 20)) for i in range(1, 121)]
    now = replay[-1][0]
    f = rules.no_progress(beats + replay, SPEC.no_progress, now=now)
    assert f is not None and f.at == t_end and f.values["step"] == high and f.action == Action.PAUSE
    assert rules.no_progress(beats, SPEC.no_progress, now=t_end) is None
    # No heartbeat for longer than alive_s: that is a hang, the supervisor's business.
    assert rules.no_progress(beats + replay, SPEC.no_progress, now=now + 1000) is None


# ---------------------------------------------------------------- shaped series

def _decaying(n: int, noise: float = 0.02) -> list[tuple[int, float]]:
    return [(s, 2.0 / math.sqrt(s) * (1 + noise * math.sin(s * 1.7))) for s in range(1, n + 1)]


def test_a_flat_loss_fires_stagnation_and_a_decaying_one_does_not():
    healthy = _decaying(400)
    assert rules.stagnation(healthy, SPEC.stagnation) is None
    flat = healthy + [(s, healthy[-1][1] * (1 + 0.01 * math.sin(s))) for s in range(401, 801)]
    f = rules.stagnation(flat, SPEC.stagnation)
    assert f is not None and f.at == 601 and f.values["improvement"] < 0.01 and f.action == Action.NOTIFY
    assert rules.stagnation(healthy[:300], SPEC.stagnation) is None  # too short to judge


def test_loss_spike_needs_a_rise_above_the_noise_and_ignores_nan():
    healthy = _decaying(200, noise=0.2)
    assert rules.loss_spike(healthy, SPEC.loss_spike) is None
    # On a perfectly flat curve the MAD is 0: a 1% wiggle has an infinite z but is no spike.
    flat = [(s, 1.0) for s in range(1, 60)] + [(60, 1.01)]
    assert rules.loss_spike(flat, SPEC.loss_spike) is None
    assert rules.loss_spike(flat + [(s, 1.5) for s in range(61, 67)], SPEC.loss_spike) is None  # 1.5x < 2x
    assert rules.loss_spike(flat + [(s, 2.5) for s in range(61, 67)], SPEC.loss_spike).at == 61
    assert rules.loss_spike(healthy[:50] + [(51, math.nan)] + healthy[51:], SPEC.loss_spike) is None


def test_gpu_idle_for_ten_minutes_fires_and_never_without_a_gpu():
    t0 = 1_000_000.0
    busy = [(t0 + 10 * i, 95.0) for i in range(60)]
    idle = [(t0 + 600 + 10 * i, 20.0) for i in range(1, 70)]
    f = rules.gpu_underutilised(busy + idle, SPEC.gpu_underutilised, now=t0 + 600 + 610)
    assert f is not None and f.at == t0 + 590 and f.values["mean_percent"] == 20.0
    assert rules.gpu_underutilised(busy + idle[:30], SPEC.gpu_underutilised, now=t0 + 900) is None
    assert rules.gpu_underutilised(busy, SPEC.gpu_underutilised, now=t0 + 5000) is None
    assert rules.gpu_underutilised([], SPEC.gpu_underutilised, now=t0) is None


def test_three_restarts_in_ten_minutes_fire_restart_storm_and_spread_ones_do_not():
    spread = [0.0, 400.0, 800.0, 1200.0]
    assert rules.restart_storm(spread, SPEC.restart_storm) is None
    f = rules.restart_storm(spread + [1300.0, 1350.0], SPEC.restart_storm)
    assert f is not None and f.at == 1300.0 and f.values["span_s"] == 500.0
    assert (f.action, f.severity) == (Action.NOTIFY, Severity.CRITICAL)  # the retry budget stops the loop


def test_budget_warns_at_80_percent_and_pauses_at_100():
    spend = [(float(t), 1.0 * t) for t in range(0, 11)]  # $1 per hour-tick, $10 budget
    w = rules.budget_warning(spend[:9], 10.0, SPEC.budget_warning, scope="team platform")
    assert w is not None and w.at == 8.0 and w.action == Action.NOTIFY
    assert w.message.startswith("budget-warning: team platform spent $8 of its $10 budget (80%")
    assert rules.budget_exhausted(spend[:9], 10.0, SPEC.budget_exhausted) is None
    x = rules.budget_exhausted(spend, 10.0, SPEC.budget_exhausted)
    assert x is not None and x.at == 10.0 and x.action == Action.PAUSE
    assert rules.budget_warning(spend[:8], 10.0, SPEC.budget_warning) is None


def test_a_disabled_rule_never_fires():
    off = AlertsSpec.model_validate({"nonfinite_loss": {"enabled": False}})
    assert rules.nonfinite_loss([(1, math.nan)], off.nonfinite_loss) is None
    assert rules.nonfinite_loss([(1, math.nan)], SPEC.nonfinite_loss) is not None


# ---------------------------------------------------------------- spec and runbooks

def test_alerts_spec_refuses_an_action_a_rule_cannot_take_and_unknown_keys():
    with pytest.raises(ValidationError, match="action 'rollback' does not apply to this alert"):
        AlertsSpec.model_validate({"straggler": {"action": "rollback"}})
    with pytest.raises(ValidationError, match="loss_spike.zz"):
        AlertsSpec.model_validate({"loss_spike": {"zz": 3}})
    with pytest.raises(ValidationError, match="greater than 1"):
        AlertsSpec.model_validate({"loss_spike": {"ratio": 1}})
    assert AlertsSpec.model_validate({"loss_spike": {"action": "pause"}}).loss_spike.action == Action.PAUSE


def test_every_rule_has_a_runbook_section_and_every_section_a_rule():
    text = (ROOT / "docs" / "runbooks.md").read_text()
    anchors = re.findall(r'^## <a id="([a-z0-9-]+)"></a>', text, flags=re.M)
    assert sorted(anchors) == sorted(r.value for r in Rule)
    assert len(anchors) == len(set(anchors))
    sections = re.split(r'^## <a id="', text, flags=re.M)[1:]
    for s in sections:
        for part in ("**What it means.**", "**How to confirm.**", "**What to do.**"):
            assert part in s, f"runbook section {s.split(chr(34))[0]} lacks {part}"
    # Every AlertsSpec field but the section's own settings is one rule, under the rule's own name.
    rule_fields = set(AlertsSpec.model_fields) - {"enabled", "every_s", "rollback", "webhook_url"}
    assert sorted(rule_fields) == sorted(r.name.lower() for r in Rule)


def test_every_rule_names_its_runbook_section_in_its_message():
    t0 = 1_000.0
    cases = {
        Rule.NONFINITE_LOSS: rules.nonfinite_loss([(1, 1.0), (2, math.inf)], SPEC.nonfinite_loss),
        Rule.LOSS_SPIKE: rules.loss_spike(_decaying(60) + [(s, 9.0) for s in range(61, 67)], SPEC.loss_spike),
        Rule.STAGNATION: rules.stagnation([(s, 1.0) for s in range(400)], SPEC.stagnation),
        Rule.VAL_NOT_IMPROVED: rules.val_not_improved([(s, 1.0 + s) for s in range(6)], SPEC.val_not_improved),
        Rule.GRAD_NORM_EXPLOSION: rules.grad_norm_explosion([(s, 1.0) for s in range(20)] + [(20, 50.0)],
                                                            SPEC.grad_norm_explosion),
        Rule.STEP_TIME_REGRESSION: rules.step_time_regression(
            [(s, 1.0) for s in range(55)] + [(s, 2.0) for s in range(55, 105)], SPEC.step_time_regression),
        Rule.STRAGGLER: rules.straggler({0: [(s, 1.0) for s in range(50)], 1: [(s, 2.0) for s in range(50)],
                                         2: [(s, 1.0) for s in range(50)]}, SPEC.straggler),
        Rule.GPU_UNDERUTILISED: rules.gpu_underutilised([(t0, 10.0), (t0 + 700, 10.0)], SPEC.gpu_underutilised,
                                                        now=t0 + 700),
        Rule.DATA_LOADER_STALL: rules.data_loader_stall([(s, 0.5) for s in range(50)], [(s, 1.0) for s in range(50)],
                                                        SPEC.data_loader_stall),
        Rule.CHECKPOINT_STALE: rules.checkpoint_stale([], t0, 60.0, SPEC.checkpoint_stale, now=t0 + 200),
        Rule.RESTART_STORM: rules.restart_storm([t0, t0 + 1, t0 + 2], SPEC.restart_storm),
        Rule.BUDGET_WARNING: rules.budget_warning([(t0, 9.0)], 10.0, SPEC.budget_warning),
        Rule.BUDGET_EXHAUSTED: rules.budget_exhausted([(t0, 10.0)], 10.0, SPEC.budget_exhausted),
        Rule.NO_PROGRESS: rules.no_progress([(t0, 5), (t0 + 1000, 5)], SPEC.no_progress, now=t0 + 1000),
    }
    assert set(cases) == set(Rule)
    for rule, f in cases.items():
        assert f is not None and f.rule == rule, rule
        spec = getattr(SPEC, rule.name.lower())
        assert (f.severity, f.action) == (spec.severity, spec.action)
        assert f.message.startswith(f"{rule.value}: ") and f.message.endswith(f"runbook docs/runbooks.md#{rule.value}]")
        assert f.runbook == f"docs/runbooks.md#{rule.value}"
        assert re.search(r"\d", f.message.split("[")[0]), f"{rule}: the message names no number: {f.message}"


def test_restarts_and_gpu_utilisation_recorded_on_a_run_are_read_back_and_judged(recorded):
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    from traingate.monitor.signals import from_mlflow

    c = MlflowClient(recorded.tracking_uri)
    rid = c.create_run(c.get_run(recorded.run_id).info.experiment_id, run_name="restarted").info.run_id
    # The tracker's restart tags (three restarts within four minutes) and NVML readings of an idle GPU.
    tags = [RunTag(f"traingate.restart.{n}.time", t) for n, t in
            ((1, "2026-01-01T10:00:00Z"), (2, "2026-01-01T10:02:00Z"), (3, "2026-01-01T10:04:00Z"))]
    t0 = 1_767_261_600_000  # 2026-01-01T10:00:00Z in ms
    gpu = [Metric("system/rank0/gpu_util_percent", 12.0, t0 + 60_000 * i, i) for i in range(12)]
    c.log_batch(rid, metrics=gpu, tags=tags)
    s = from_mlflow(c, rid)
    assert s.restart_times == [t0 / 1000 + 120 * i for i in range(3)]
    fired = {f.rule: f for f in rules.evaluate(s, SPEC, now=t0 / 1000 + 660)}
    assert set(fired) == {Rule.RESTART_STORM, Rule.GPU_UNDERUTILISED}
    assert fired[Rule.RESTART_STORM].values["span_s"] == 240.0
    assert fired[Rule.GPU_UNDERUTILISED].values == {"seconds": 660.0, "mean_percent": 12.0}
