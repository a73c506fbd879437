"""`traingate drill`: many faults of several kinds in one run, and the final weights still match bit for bit."""
from __future__ import annotations

import json

import pytest

from traingate.supervision.drill import EXPECTED_CAUSE

pytestmark = pytest.mark.slow

DRILL_SPEC = """
stages:
  full: {max_steps: 30}
checkpoint: {every_steps: 4}
tracking: {enabled: false, log_every: 2}
supervision: {backoff_base_s: 0.2, backoff_max_s: 1.0, hang_timeout_s: 6}
"""


def test_drill_with_five_faults_of_four_kinds_finishes_with_bitwise_equal_weights(tiny_spec, state_dir, tmp_path,
                                                                                 capsys):
    from flows.cli import main as cli

    report_path = tmp_path / "drill.json"
    rc = cli(["drill", str(tiny_spec(DRILL_SPEC)), "--faults", "5", "--seed", "2", "--json", str(report_path)])
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert rc == 0, out
    assert report["passed"] and report["weights_equal"] and report["mismatched"] == []
    kinds = {f["kind"] for f in report["faults"]}
    assert len(report["faults"]) >= 5 and kinds == {"kill", "term", "stop", "io"}
    assert report["recoveries"] >= 5
    for f in report["faults"]:  # each fault ended its own launch, was named right, and was recovered from
        assert f["classified_as"] == EXPECTED_CAUSE[f["kind"]], f
        assert f["recovery_s"] is not None and f["recovery_s"] > 0
    assert report["steps_executed"] >= report["steps"] == 30
    assert 0 < report["goodput"] <= 1
    assert "drill PASSED" in out and "bitwise equal" in out and "goodput" in out


def test_drill_refuses_a_plan_that_does_not_fit_the_stage(tiny_spec, state_dir, capsys):
    from flows.cli import main as cli

    assert cli(["drill", str(tiny_spec(DRILL_SPEC)), "--faults", "20"]) == 2
    assert "do not fit in 30 steps" in capsys.readouterr().out
