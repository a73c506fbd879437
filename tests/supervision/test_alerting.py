"""How the supervisor says an alert fired: a critical one at ERROR, the others at INFO."""

from __future__ import annotations

from pathlib import Path

from traingate.alerts.rules import Action, Firing, Rule, Severity
from traingate.job.stagejob import derive
from traingate.settings import Settings
from traingate.spec import load_spec
from traingate.supervision.alerting import AlertActions
from traingate.supervision.attempts import Hooks


def test_a_critical_alert_is_said_through_the_error_hook_and_a_warning_through_info(tiny_spec, state_dir, tmp_path):
    spec = load_spec(tiny_spec("tracking: {enabled: false}\n"))
    job = derive(spec, "full", run_id="r1", run_dir=tmp_path / "r1", settings=Settings.from_env())
    Path(job.stage_dir).mkdir(parents=True)  # the supervisor makes it before the first launch
    said: list[tuple[str, str]] = []
    hooks = Hooks(info=lambda m: said.append(("info", m)), error=lambda m: said.append(("error", m)))
    actions = AlertActions(job, hooks, None, 0.0, lambda reason: None)
    actions.record(Firing(Rule.LOSS_SPIKE, Severity.CRITICAL, Action.NOTIFY, 7, "loss 9.1 > 4x median"), "notified")
    actions.record(Firing(Rule.GRAD_NORM_EXPLOSION, Severity.WARNING, Action.NOTIFY, 8, "grad norm 40"), "notified")
    assert said == [
        ("error", "full: ALERT critical loss 9.1 > 4x median -> notified"),
        ("info", "full: ALERT warning grad norm 40 -> notified"),
    ]
