"""Sizing and cost estimates, and the dry-run plan built from them."""
from __future__ import annotations

import pytest

from traingate.job import sizing
from traingate.job.stagejob import derive
from traingate.ladder.outcomes import _estimate_next
from traingate.settings import Settings
from traingate.ladder.plan import plan, render, stages_until
from traingate.spec import load_spec
from traingate.ladder.preflight import check_spec


def test_cost_is_wall_hours_times_slots_times_price():
    assert sizing.cost_usd(3600, 8, 2.5) == pytest.approx(20.0)


def test_estimate_uses_mean_step_time_plus_startup():
    est = sizing.estimate_stage({"step_time_mean_s": 0.2, "step_time_p99_s": 5.0, "startup_s": 4.0},
                                steps=100, slots=2, price_per_slot_hour=3.6)
    assert est["wall_s"] == pytest.approx(24.0)
    assert est["cost_usd"] == pytest.approx(24.0 / 3600 * 2 * 3.6)


def test_canary_profile_estimates_the_full_stage_on_the_full_world(tiny_spec):
    spec = load_spec(tiny_spec("budget: {max_cost_usd: 5}\n"), ["resources.work_pool=gpu-a100",
                                                                "resources.procs_per_node=4"])
    canary = derive(spec, "canary", run_id="r", run_dir="/tmp/tg-sizing/r",
                    settings=Settings.from_env({"TRAINGATE_STATE_DIR": "/tmp/tg-sizing"}))
    est = _estimate_next(canary.spec, canary.stage, {"step_time_mean_s": 1.0, "startup_s": 0.0})
    # 16 full steps x 1 s on 4 GPUs at $2.50/GPU-hour
    assert est["next_stage_wall_s"] == pytest.approx(16.0)
    assert est["next_stage_cost_usd"] == pytest.approx(16 / 3600 * 4 * 2.5)


def test_plan_lists_every_stage_up_to_until_with_limits_and_ceilings(tiny_spec):
    spec = load_spec(tiny_spec())
    rows = plan(spec, check_spec(spec), "canary")
    assert [r["stage"] for r in rows] == stages_until("canary") == ["unit", "smoke", "canary"]
    assert rows[1]["processes"] == 1 and rows[1]["steps"] == 4 and rows[1]["samples"] == 64
    assert rows[2]["processes"] == 2 and rows[2]["cost_ceiling_usd"] > 0
    text = render(rows, spec)
    assert "canary" in text and "loss_decrease_fraction >= 0.05" in text


def test_plan_with_a_previous_profile_gives_estimates(tiny_spec):
    spec = load_spec(tiny_spec())
    rows = plan(spec, check_spec(spec), "full", profile={"step_time_mean_s": 0.5, "startup_s": 1})
    assert rows[3]["est_wall_s"] == pytest.approx(1 + 16 * 0.5)
