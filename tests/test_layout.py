"""Design decisions guarded by tests: the core library never imports prefect; the
deployment file and the compose file are valid and point at real flows and pools."""
from __future__ import annotations

import inspect
import subprocess
from pathlib import Path

import yaml

from tgtest import PYTHON, ROOT
from traingate.spec import _default_pools


def test_traingate_never_imports_prefect():
    code = (
        "import pkgutil, importlib, sys, traingate\n"
        "for m in pkgutil.walk_packages(traingate.__path__, 'traingate.'):\n"
        "    if '.checks.' not in m.name: importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n == 'prefect' or n.startswith('prefect.'))\n"
        "print(len(bad)); sys.exit(1 if bad else 0)\n")
    p = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, f"traingate imported prefect: {p.stdout} {p.stderr[-2000:]}"


def _deployments():
    return yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]


def test_every_deployment_points_at_a_flow_that_takes_its_parameters():
    from prefect.flows import load_flow_from_entrypoint

    for d in _deployments():
        path, name = d["entrypoint"].split(":")
        flow = load_flow_from_entrypoint(str(ROOT / path) + ":" + name)
        params = inspect.signature(flow.fn).parameters
        assert set(d["parameters"]) <= set(params), d["name"]
        # what a worker does before the flow starts: a spec mapping must be a valid RunSpec
        flow.validate_parameters(d["parameters"])


def test_deployed_spec_mappings_are_the_example_specs_on_their_pools():
    from traingate.spec import load_spec, parse_spec

    specs = {d["name"]: parse_spec(d["parameters"]["spec"]) for d in _deployments() if "spec" in d["parameters"]}
    digits, sweep = ROOT / "examples" / "digits.yaml", ROOT / "examples" / "digits_sweep.yaml"
    assert specs == {
        "ladder-cpu": load_spec(digits),
        "digits-nightly-retrain": load_spec(digits),
        "ladder-a100": load_spec(digits, ["resources.work_pool=gpu-a100"]),
        "sweep-h100": load_spec(sweep, ["resources.work_pool=gpu-h100"]),
    }


def test_resume_deployment_asks_only_for_the_run_to_resume():
    resume = next(d for d in _deployments() if d["name"] == "ladder-resume")
    assert resume["entrypoint"] == "flows/pipeline.py:ladder"
    assert "spec" not in resume["parameters"] and "resume_from" not in resume["parameters"]


def test_every_deployment_uses_a_known_work_pool():
    pools = set(_default_pools())
    for d in _deployments():
        assert d["work_pool"]["name"] in pools, d["name"]


def test_compose_file_is_valid_against_the_compose_spec():
    exe = Path(PYTHON).parent / "check-jsonschema"
    exe = str(exe) if exe.exists() else "check-jsonschema"
    p = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "infra" / "docker-compose.yml")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_prefect_deploy_creates_every_deployment_with_its_schedule(prefect_harness, tmp_path):
    import os

    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as c:
        for pool, kind in (("cpu-local", "process"), ("gpu-a100", "process"), ("gpu-h100", "process")):
            try:
                c.create_work_pool(WorkPoolCreate(name=pool, type=kind))
            except Exception as e:  # noqa: BLE001 - already exists from an earlier test in the session
                assert "already exists" in str(e).lower(), e
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "TRAINGATE_CODE_DIR": str(ROOT),
           "TRAINGATE_IMAGE": "traingate-train:test", "PREFECT_HOME": str(tmp_path / "home")}
    p = subprocess.run([str(Path(PYTHON).parent / "prefect"), "--no-prompt", "deploy", "--all",
                        "--prefect-file", "deployments/prefect.yaml"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with get_client(sync_client=True) as c:
        deployed = {d.name: d for d in c.read_deployments()}
    for d in _deployments():
        assert d["name"] in deployed
        assert deployed[d["name"]].work_pool_name == d["work_pool"]["name"]
    nightly = deployed["digits-nightly-retrain"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
