"""What a script stage reports about itself, under the real supervisor: a stage whose output no metric
regex matched trained no step traingate can see, and fails naming the regex and the script's last lines."""
from __future__ import annotations

import time
from pathlib import Path

from traingate.job.stagejob import derive
from traingate.job.vocab import Status
from traingate.ladder import outcomes
from traingate.ladder.gates import decide
from traingate.ladder.preflight import check_spec
from traingate.settings import Settings
from traingate.spec import parse_spec
from traingate.supervision.supervisor import Hooks, supervise

# Prints its loss as "loss: 0.5", while the spec's regex expects "loss=0.5".
TRAIN = """
for step in range(1, 6):
    print(f"epoch 1 step {step} loss: {1.0 / step:.3f}", flush=True)
print("training done", flush=True)
"""


def _run(tmp_path: Path, metrics: list[str], **sections):
    workdir = tmp_path / "project"
    workdir.mkdir()
    (workdir / "train.py").write_text(TRAIN)
    spec = parse_spec({"identity": {"experiment": "scripts", "owner": "tester", "team": "platform",
                                    "purpose": "a script whose output the spec's regex may not match"},
                       "recipe": {"name": "script", "script": {"workdir": str(workdir), "metrics": metrics,
                                                                "command": ["python", "train.py"]}},
                       "resources": {"work_pool": "cpu-local", "procs_per_node": 1}, **sections})
    check_spec(spec)
    settings = Settings.from_env()
    job = derive(spec, "smoke", run_id="nosteps", run_dir=settings.state_dir / "runs" / "nosteps", settings=settings)
    t0 = time.monotonic()
    sup = supervise(job, Hooks(), seed=0)
    return spec, sup, outcomes.from_supervision(job, sup, time.monotonic() - t0)


def test_a_script_stage_whose_metric_regex_matched_nothing_fails_naming_the_regex_and_its_last_lines(
        tmp_path, state_dir):
    regex = r"loss=(?P<loss>[0-9.]+)"
    spec, sup, result = _run(tmp_path, [regex])
    assert sup.status == Status.COMPLETED  # the script itself exited 0
    assert result.status == Status.FAILED and result.metrics["steps"] == 0
    assert "\n" not in result.error and f"'{regex}'" in result.error, result.error
    assert "'epoch 1 step 5 loss: 0.200' | 'training done'" in result.error, result.error
    decision = decide(result, spec.gate("smoke"))  # the default smoke gate of a script: nonfinite_steps == 0
    assert not decision.passed
    assert decision.reasons[0].startswith("stage ended failed: no line of the script's output matched"), decision.reasons


def test_the_same_script_with_a_regex_that_matches_its_output_passes_the_smoke_gate(tmp_path, state_dir):
    spec, sup, result = _run(tmp_path, [r"step (?P<step>\d+) loss: (?P<loss>[0-9.]+)"])
    assert result.status == Status.COMPLETED and result.metrics["steps"] == 5, result.error
    assert decide(result, spec.gate("smoke")).passed


def test_a_script_without_metric_regexes_fails_its_default_smoke_gate_on_zero_steps(tmp_path, state_dir):
    """No regex, so no line can be matched and no step seen: the default gate does not pass it vacuously."""
    # Its canary needs a gate of its own (nothing reports a loss trend); smoke keeps the default.
    spec, sup, result = _run(tmp_path, [], gates={"canary": {"rules": [{"metric": "steps", "op": ">=", "value": 1}]}})
    assert sup.status == Status.COMPLETED and result.metrics["steps"] == 0
    decision = decide(result, spec.gate("smoke"))
    assert not decision.passed and decision.reasons == ["steps = 0, required >= 1"], decision.reasons
