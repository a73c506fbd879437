"""alerts.checkpoint_stale under the real supervisor (torchrun, digits, one rank): its factor decides when
it fires, its action is carried out (pause: the tree stops at an emergency checkpoint, resumable), and
disabled it stays silent. Each step sleeps 0.1 s (TRAINGATE_INJECT slow@0) while a checkpoint is due
every 0.06 s (checkpoint.every_minutes: 0.001), so checkpoints lag their interval; a factor of 100 lets
them."""
from __future__ import annotations

from pathlib import Path

import pytest

from traingate.job import files
from traingate.job.stagejob import derive
from traingate.job.vocab import Status
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision.supervisor import Hooks, supervise

pytestmark = pytest.mark.slow

SPEC = """
tracking: {enabled: false, log_every: 2}
checkpoint: {every_steps: null, every_minutes: 0.001, async_save: false}
supervision: {backoff_base_s: 0.2, backoff_max_s: 1.0, hang_timeout_s: 60, checkpoint_check_s: 0.2,
              preempt_grace_s: 20, max_restarts: 0}
"""


def _run(tiny_spec, tmp_path: Path, monkeypatch, *sets: str, steps: int = 30):
    monkeypatch.setenv("TRAINGATE_INJECT", "slow@0")
    spec = load_spec(tiny_spec(SPEC), [f"stages.full.max_steps={steps}", "resources.procs_per_node=1", *sets])
    job = derive(spec, "full", run_id="stale", run_dir=tmp_path / "run", settings=Settings.from_env())
    said: list[str] = []
    sup = supervise(job, hooks=Hooks(info=said.append), seed=0)
    return sup, files.read_alerts(Path(job.stage_dir)), said


def test_a_stale_checkpoint_fires_its_alert_and_pauses_the_stage_when_its_action_is_pause(
        tiny_spec, tmp_path, state_dir, monkeypatch):
    sup, alerts, said = _run(tiny_spec, tmp_path, monkeypatch,
                             "alerts.checkpoint_stale={factor: 1.0, action: pause, severity: critical}",
                             steps=200)  # the pause lands long before the stage could end, on a busy box too
    stale = [a for a in alerts if a.rule == "checkpoint-stale"]
    assert len(stale) == 1, [a.message for a in alerts]
    assert stale[0].action == "pause" and stale[0].severity == "critical", stale[0]
    assert "limit 1x" in stale[0].message and "paused at an emergency checkpoint" in stale[0].outcome, stale[0]
    assert sup.status == Status.PREEMPTED, (sup.status, sup.error)  # stopped at a checkpoint, resumable
    assert sup.attempts[-1].end_step < 200


def test_a_checkpoint_within_factor_times_its_interval_raises_no_alert_and_the_stage_completes(
        tiny_spec, tmp_path, state_dir, monkeypatch):
    sup, alerts, _ = _run(tiny_spec, tmp_path, monkeypatch, "alerts.checkpoint_stale={factor: 100.0, action: pause}")
    assert sup.status == Status.COMPLETED, sup.error
    assert not [a for a in alerts if a.rule == "checkpoint-stale"]


def test_a_disabled_checkpoint_stale_rule_stays_silent(tiny_spec, tmp_path, state_dir, monkeypatch):
    sup, alerts, said = _run(tiny_spec, tmp_path, monkeypatch,
                             "alerts.checkpoint_stale={enabled: false, factor: 1.0, action: pause}")
    assert sup.status == Status.COMPLETED, sup.error
    assert not [a for a in alerts if a.rule == "checkpoint-stale"]
    assert not any("checkpoint-stale" in line for line in said)
