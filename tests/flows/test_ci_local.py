"""`traingate ci SPEC`: the ladder's cheap stages of the checked-out code, with the exit code as the verdict
(0 passed, 1 a gate refused, 2 bad input), a summary for the CI log and a markdown summary file; on a
temporary Prefect server, or on the one PREFECT_API_URL names. The example GitHub workflow that calls it
passes GitHub's workflow schema (SchemaStore's, bundled with check-jsonschema)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tgtest import PYTHON, ROOT

WORKFLOW = ROOT / "deployments" / "ci" / "github-actions.yml"


def _ci(tmp_path: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**(env or os.environ), "TRAINGATE_STATE_DIR": str(tmp_path / "state")}
    env.setdefault("PREFECT_HOME", str(tmp_path / "prefect"))
    return subprocess.run(
        [PYTHON, "-m", "flows.cli", "ci", *argv], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )


@pytest.mark.slow
def test_ci_passes_with_exit_0_on_a_temporary_server_and_writes_the_github_step_summary(tiny_spec, tmp_path):
    summary = tmp_path / "step-summary.md"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    p = _ci(tmp_path, str(tiny_spec()), "--until", "unit", env={**env, "GITHUB_STEP_SUMMARY": str(summary)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"ci {tiny_spec()} up to unit: PASSED: unit passed" in p.stdout
    stages = [line.split()[:4] for line in p.stdout.splitlines() if line.startswith("  unit")]
    assert stages == [["unit", "completed", "gate", "passed"]]
    md = summary.read_text()
    assert md.startswith(f"## traingate ci: {tiny_spec()} up to unit: PASSED\n")
    assert "| unit | completed | passed |" in md


@pytest.mark.slow
def test_ci_exits_1_on_a_failed_gate_naming_the_rule_on_the_server_prefect_api_url_names(
    tiny_spec, tmp_path, prefect_api
):
    from prefect import get_client

    rule = 'gates.unit.rules=[{metric: tests_passed, op: ">=", value: 1000}]'
    p = _ci(
        tmp_path,
        str(tiny_spec()),
        "--until",
        "unit",
        "--set",
        rule,
        "--summary",
        "ci.md",
        env={**os.environ, **prefect_api},
    )
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "up to unit: FAILED: gate after unit: FAILED: tests_passed = " in p.stdout
    (run_dir,) = (tmp_path / "state" / "runs").iterdir()
    flow_run_id = json.loads((run_dir / "orchestrator.json").read_text())["flow_run_id"]
    with get_client(sync_client=True) as c:  # the session's server, the one PREFECT_API_URL named
        assert c.read_flow_run(flow_run_id).state.type.value == "FAILED"  # on that server, not on a temporary one
    md = (tmp_path / "ci.md").read_text()
    assert ": FAILED\n" in md.splitlines(keepends=True)[0] and "| unit | completed | **failed** |" in md


@pytest.mark.parametrize(
    "argv, why",
    [
        (["missing.yaml"], "missing.yaml"),
        ([], "give a spec file (traingate ci examples/digits.yaml) or --commit"),
        (["examples/digits.yaml", "--until", "full"], "--until 'full': CI runs the cheap stages unit, smoke, canary"),
        (["examples/digits.yaml", "--commit", "abc1234"], "give a spec file (run here) or --commit SHA"),
        (["examples/digits.yaml", "--set", "optim.lr=fast"], "optim.lr"),
    ],
)
def test_ci_refuses_bad_input_with_exit_2_in_one_line_and_starts_nothing(tmp_path, argv, why, monkeypatch, capsys):
    from flows.cli import main

    # In this process: a refusal comes before anything heavy is imported, so a subprocess would add only its
    # interpreter start (tests/test_disk_full.py checks a refused `traingate run` process's exit code).
    argv = [str(ROOT / a) if a.endswith(".yaml") else a for a in argv]
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    code = main(["ci", *argv])
    out, err = capsys.readouterr()
    assert code == 2, out[-2000:] + err[-2000:]
    assert why in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "state").exists()


def test_the_example_github_workflow_passes_githubs_workflow_schema_and_calls_traingate_ci(tmp_path):
    exe = Path(PYTHON).parent / "check-jsonschema"
    check = [str(exe) if exe.exists() else "check-jsonschema", "--builtin-schema", "vendor.github-workflows"]
    p = subprocess.run([*check, str(WORKFLOW)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    text = WORKFLOW.read_text()
    assert "run: traingate ci examples/digits.yaml --until canary" in text and "traingate ci --commit" in text
    broken = tmp_path / "broken.yml"  # the check can fail: a job without runs-on is not a workflow
    broken.write_text(text.replace("    runs-on: ubuntu-latest\n", "", 1))
    assert subprocess.run([*check, str(broken)], capture_output=True, text=True, timeout=120).returncode == 1
