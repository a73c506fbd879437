"""The Slurm cluster the Slurm tests run against: one per test session (see cluster.py).

`slurm_cluster` starts it once (~4-10 s here), points this process's environment at it
(SLURM_CONF, PATH) so sbatch/squeue and their children reach it, and tears it down at the end.
`slurm` is the same cluster for one test, put back after it (jobs cancelled, nodes up and idle,
GPU caps lifted, PreemptMode REQUEUE). Without root or without the Debian packages every test
here is skipped with one line naming what is missing (`make test-deps` installs them).
Every test under tests/slurm carries the `slurm` marker (`pytest -m slurm` / `-m "not slurm"`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm.cluster import SlurmCluster, missing_binaries

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm test cluster: {missing[0]} is not installed (make test-deps installs it)")
    if os.geteuid() != 0:
        pytest.skip("Slurm test cluster: needs root (network namespaces, OS users, cgroups)")
    # Not pytest's basetemp: it is 0700 (and pytest re-tightens it), and the test users must
    # traverse the path to the cluster's shared directory.
    base = Path(tempfile.mkdtemp(prefix="traingate-slurm-"))
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PATH")}
    cluster = None
    try:
        cluster = SlurmCluster.start(base)
        os.environ.update(cluster.env)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    yield slurm_cluster
    slurm_cluster.reset()
