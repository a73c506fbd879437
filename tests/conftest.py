"""Shared fixtures: every test runs against real, lightweight backends in temp dirs.

Environment isolation happens at import, before anything imports prefect: the
session's Prefect home, MLflow store and checkpoints all live in one temp dir.
"""
from __future__ import annotations

import os
import tempfile
import textwrap
from pathlib import Path

import pytest
from tgtest import PYTHON, ROOT, TINY_DIGITS, free_port  # noqa: F401 - re-exported for fixtures

from flows import local_server

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="traingate-tests-"))
os.environ["TRAINGATE_STATE_DIR"] = str(_SESSION_DIR / "state")
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# A CLI without PREFECT_API_URL uses a temporary Prefect server, as in CI: a kept one would outlive the test
# (tests/flows/test_local_server.py starts kept servers on purpose and stops them).
os.environ["TRAINGATE_PREFECT_SERVER"] = "temporary"
for var in ("TRAINGATE_TRACKING_URI", "TRAINGATE_CHECKPOINT_URI", "TRAINGATE_ARTIFACT_URI",
            "TRAINGATE_S3_ENDPOINT_URL", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "PREFECT_API_URL"):
    os.environ.pop(var, None)
# One cache of migrated, empty Prefect databases for the whole run (xdist's workers inherit the controller's
# environment): a Prefect server a test starts on a new database (tgtest.prefect_server, a CLI's temporary or
# kept server) starts on a copy instead of migrating its own (flows/local_server.py, seed_database).
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ[local_server.CACHE_VAR] = tempfile.mkdtemp(prefix="traingate-tests-prefect-db-")
# Every Prefect server the suite starts from this environment (the session's, a test's `prefect server start`,
# a CLI's temporary one) demands one auth string, and every client here and in subprocesses sends it.
local_server.authenticate_temporary()



@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    """A fresh traingate state dir (MLflow sqlite, checkpoints, run dirs) for one test."""
    d = tmp_path / "state"
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(d))
    return d


@pytest.fixture(scope="session")
def prefect_harness():
    """A real (temporary) Prefect server for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def prefect_api(prefect_harness) -> dict[str, str]:
    """The environment a CLI subprocess needs to record its flow runs on the session's Prefect server.

    PREFECT_API_AUTH_STRING is the session's auth string: every server the suite starts demands it.
    Without PREFECT_API_URL `traingate run` (resume, sweep, ci) starts a temporary server of its own,
    ~15 s per call on 2 shared cores. Tests whose subject is that temporary server (its start, its
    shield against a terminal's Ctrl-C) do not take this fixture.
    """
    from prefect.settings import PREFECT_API_URL

    auth = local_server.CLIENT_AUTH_VAR
    return {"PREFECT_API_URL": PREFECT_API_URL.value(), auth: os.environ[auth]}





@pytest.fixture
def tiny_spec(tmp_path):
    """Write a tiny digits spec (optionally with extra YAML appended) and return its path."""
    def make(extra: str = "", name: str = "spec.yaml") -> Path:
        # Sections in `extra` are merged into the tiny spec's (a spec may not repeat a key).
        import yaml

        def merge(base: dict, more: dict) -> dict:
            for k, v in more.items():
                base[k] = merge(dict(base[k]), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
            return base

        tree = merge(yaml.safe_load(TINY_DIGITS), yaml.safe_load(textwrap.dedent(extra)) or {})
        p = tmp_path / name
        p.write_text(yaml.safe_dump(tree, sort_keys=False))
        return p
    return make


@pytest.fixture
def s3_server(monkeypatch):
    """A real S3 HTTP endpoint on loopback (moto server mode) with a bucket `tg-test`."""
    from moto.server import ThreadedMotoServer

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-key-do-not-log")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("TRAINGATE_S3_ENDPOINT_URL", endpoint)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="tg-test")
    yield {"endpoint": endpoint, "bucket": "tg-test", "server": server, "port": port}
    server.stop()


def _is_long(item) -> bool:
    """A test that takes seconds to minutes: marked slow or long, or run on the Slurm test cluster."""
    return any(item.get_closest_marker(m) is not None for m in ("slow", "long")) or \
        bool({"slurm", "slurm_cluster"} & set(item.fixturenames))


def pytest_collection_modifyitems(config, items):
    """Files with the most long tests first, each file's tests kept together and in order: under
    `make test`'s workers (`--dist loadfile --no-loadscope-reorder`, which keeps this order) the long
    files start early and the many short ones fill the end, instead of a long file starting last
    while the other worker idles. Among files with as many long tests, those with more tests go first
    (xdist's default order, by test count alone, starts the one-test end-to-end files last)."""
    long: dict = {}
    count: dict = {}
    for item in items:
        long[item.path] = long.get(item.path, 0) + _is_long(item)
        count[item.path] = count.get(item.path, 0) + 1
    items.sort(key=lambda item: (-long[item.path], -count[item.path]))


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(_SESSION_DIR, ignore_errors=True)
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the process that made the database cache
        shutil.rmtree(os.environ[local_server.CACHE_VAR], ignore_errors=True)
