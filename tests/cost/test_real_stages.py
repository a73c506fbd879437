"""Attempts and scaling from real stages: the tiny digits smoke stopped half way and resumed as the launch
task does, and canaries at 1 and 2 processes (real torchrun, gloo, CPU; no MLflow)."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from traingate.ladder import outcomes
from traingate.cost import scaling
from traingate.job.stagejob import derive
from traingate.job.vocab import Status
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision.supervisor import Hooks, supervise
from tgtest import TINY_DIGITS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """Smoke (two halves) and canary of one run at 2 processes; a canary of the same spec at 1 process."""
    tmp = tmp_path_factory.mktemp("real")
    spec_path = tmp / "spec.yaml"
    spec_path.write_text(TINY_DIGITS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINGATE_STATE_DIR", str(tmp / "state"))
        settings = Settings.from_env()
        out = {}
        for procs in (2, 1):
            spec = load_spec(spec_path, [f"resources.procs_per_node={procs}", "tracking.enabled=false"])
            run_dir = tmp / f"run{procs}"
            if procs == 2:
                smoke = derive(spec, "smoke", run_id="r2", run_dir=run_dir, settings=settings)
                t0 = time.monotonic()
                first = supervise(dataclasses.replace(smoke, stop_at_step=smoke.max_steps // 2), Hooks(), seed=0)
                second = supervise(smoke, Hooks(), seed=0)
                out["smoke"] = (first, second, outcomes.from_supervision(smoke, second, time.monotonic() - t0,
                                                                         before=[first]))
            canary = derive(spec, "canary", run_id=f"r{procs}", run_dir=run_dir, settings=settings)
            sup = supervise(canary, Hooks(), seed=0)
            out[f"canary{procs}"] = (canary, outcomes.from_supervision(canary, sup, 1.0))
        yield out


def test_smoke_stop_and_resume_is_charged_as_two_attempts_of_the_stage(stages):
    first, second, result = stages["smoke"]
    assert first.status == second.status == result.status == Status.COMPLETED
    [a], [b] = first.attempts, second.attempts
    price = 0.05  # cpu-local, smoke on 1 process = 1 slot
    assert [(r["number"], r["start"], r["end"], r["slots"], r["outcome"]) for r in result.attempts] == [
        (0, a.launched_at, a.ended_at, 1, "completed"), (1, b.launched_at, b.ended_at, 1, "completed")]
    assert [r["idle_s"] for r in result.attempts] == [a.first_step_time - a.launched_at,
                                                       b.first_step_time - b.launched_at]
    held = (a.ended_at - a.launched_at) + (b.ended_at - b.launched_at)
    assert sum(r["usd"] for r in result.attempts) == pytest.approx(held / 3600 * price, rel=1e-12)
    assert result.metrics["restarts"] == 0  # the deliberate stop is charged, not counted as a restart


def test_canary_result_holds_the_smokes_estimate_of_it_beside_its_charged_attempts(stages):
    _, _, smoke = stages["smoke"]
    _, canary = stages["canary2"]
    assert canary.estimated_cost_usd == pytest.approx(smoke.estimate["next_stage_cost_usd"], rel=1e-12)
    assert canary.estimated_cost_usd > 0
    [a] = canary.attempts
    assert (a["slots"], a["pool"], a["outcome"]) == (2, "cpu-local", "completed")
    assert a["usd"] == pytest.approx((a["end"] - a["start"]) / 3600 * 2 * 0.05, rel=1e-12)


def test_scaling_advice_from_real_canary_profiles_at_1_and_2_processes(stages):
    p1 = stages["canary1"][1].details["profile"]
    p2 = stages["canary2"][1].details["profile"]
    a = scaling.advise(p1, p2, 2, price_per_slot_hour=0.05)
    # Hand-computed from the recorded throughputs: the sentence's numbers are these.
    eff = p2["samples_per_s"] / (2 * p1["samples_per_s"])
    assert a.efficiency == pytest.approx(eff, rel=1e-12)
    assert a.usd_per_million_samples(2) / a.usd_per_million_samples(1) == pytest.approx(1 / eff, rel=1e-12)
    assert f"scaling efficiency {100 * eff:.0f}%" in a.sentence
    assert a.pays_off == (eff >= 0.75 and p2["samples_per_s"] > p1["samples_per_s"])
    print(f"\nreal canary profiles: 1 process {p1['samples_per_s']:.1f} samples/s, 2 processes "
          f"{p2['samples_per_s']:.1f} samples/s\n{a.sentence}")


def test_scaling_advice_hand_computed_cases():
    # 1 process 200 samples/s; 8 processes 960: efficiency 0.6, a sample costs 1/0.6 = 1.67x.
    a = scaling.advise({"samples_per_s": 200.0}, {"samples_per_s": 960.0}, 8, price_per_slot_hour=2.5)
    assert (a.efficiency, a.speedup, a.pays_off) == (pytest.approx(0.6), pytest.approx(4.8), False)
    assert a.usd_per_million_samples(1) == pytest.approx(2.5 / 3600 / 200 * 1e6)   # $3.4722
    assert a.usd_per_million_samples(8) == pytest.approx(8 * 2.5 / 3600 / 960 * 1e6)  # $5.7870
    assert a.sentence.endswith("adding processes stops paying off (efficiency < 75%); use fewer, unless finishing "
                               "sooner is worth the extra cost.")
    slower = scaling.advise({"samples_per_s": 100.0}, {"samples_per_s": 90.0}, 2, price_per_slot_hour=1.0)
    assert slower.efficiency == pytest.approx(0.45) and "2 processes are no faster than 1" in slower.sentence
    assert scaling.advise({"samples_per_s": 100.0}, {"samples_per_s": 190.0}, 2, 1.0, min_efficiency=0.95).pays_off
    with pytest.raises(ValueError, match=r"profile at 2 processes: samples_per_s = None; needs a measured throughput"):
        scaling.advise({"samples_per_s": 100.0}, {}, 2, 1.0)
    with pytest.raises(ValueError, match="processes = 1: scaling compares 1 process with 2 or more"):
        scaling.advise({"samples_per_s": 100.0}, {"samples_per_s": 100.0}, 1, 1.0)
