"""The deployed `stage` flow resolves data.uri's {latest} as `traingate run` does: the version the LATEST
pointer names, recorded in the run's resolved spec and trained on."""
from __future__ import annotations

import argparse

import pytest
import yaml

from traingate.settings import Settings
from traingate.spec import load_spec

TRAIN = """
for step in range(1, 4):
    print(f"step {step} loss {1.0 / step:.3f}", flush=True)
"""


@pytest.mark.slow  # a flow run on the session server, a script stage and its MLflow runs (~40 s on a loaded 2-core box)
def test_the_deployed_stage_flow_resolves_latest_to_the_version_the_cli_resolves(
        prefect_harness, state_dir, tmp_path):
    from flows.cli.validate import _load
    from flows.stage import train_stage

    data = tmp_path / "corpus"
    for version in ("v1", "v2"):
        (data / version).mkdir(parents=True)
        (data / version / "input.txt").write_text(f"snapshot {version}\n")
    (data / "LATEST").write_text("v1\n")  # the pointer wins over the newer name
    workdir = tmp_path / "project"
    workdir.mkdir()
    (workdir / "train.py").write_text(TRAIN)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({
        "identity": {"experiment": "latest", "owner": "tester", "team": "platform", "purpose": "resolve {latest}"},
        "recipe": {"name": "script", "script": {"workdir": str(workdir), "command": ["python", "train.py"],
                                                "metrics": [r"step (?P<step>\d+) loss (?P<loss>\S+)"]}},
        "data": {"uri": f"{data.as_uri()}/{{latest}}/input.txt"},
        "resources": {"work_pool": "cpu-local", "procs_per_node": 1},
    }))

    cli_spec, _ = _load(argparse.Namespace(cmd="run", spec=str(spec_file), overrides=[]))
    assert cli_spec.data.uri == f"{data.as_uri()}/v1/input.txt"

    state = train_stage(load_spec(spec_file), "smoke", return_state=True)  # as a deployment hands it the spec
    assert state.is_completed(), state.message
    run_dir = Settings.from_env().state_dir / "runs" / state.result()["run_id"]
    assert yaml.safe_load((run_dir / "spec.yaml").read_text())["data"]["uri"] == cli_spec.data.uri
