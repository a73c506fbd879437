"""Container pools: what a flow-run container gets from its pool (the GPUs, the servers' network, the
state volume, the names of its credentials' Secret blocks, never a credential), and the credentials
themselves through Prefect Secret blocks on a real (test harness) server. No Docker engine here: the
container's configuration is computed by prefect-docker's own worker configuration, not run."""
from __future__ import annotations

import asyncio
import json

import pytest

from traingate.capacity.pools import CapacityError, parse_config
from traingate.settings import LocationError, pool_locations

POOLS = {"pools": {"gpu-h100": {"gpu": "H100-80GB", "gpus_per_node": 8, "nodes": 1, "price_per_gpu_hour": 4.0,
                                "worker": "docker"},
                   "cpu-docker": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 0.0, "worker": "docker"}}}
BLOCKS = "AWS_SECRET_ACCESS_KEY=tg-test-aws-secret,PGPASSWORD=tg-test-pgpassword"
ENV = {"TRAINGATE_STATE_DIR": "/var/lib/traingate", "TRAINGATE_TRACKING_URI": "http://mlflow:5000",
       "TRAINGATE_DOCKER_NETWORKS": "traingate", "TRAINGATE_DOCKER_VOLUMES": "traingate_state:/var/lib/traingate",
       "TRAINGATE_SECRET_BLOCKS": BLOCKS, "AWS_SECRET_ACCESS_KEY": "aws-secret-value-1", "PGPASSWORD": "pg-value-2"}


def _job(pool: str, env: dict[str, str], values: dict | None = None):
    from prefect_docker.worker import DockerWorkerJobConfiguration

    from flows.cli.pools import job_template

    cfg = parse_config(POOLS)
    template = job_template(cfg.pools[pool], "ghcr.io/acme/train:2026.11.23", pool, pool_locations(pool, env), env)
    return template, asyncio.run(DockerWorkerJobConfiguration.from_template_and_values(template, values or {}))


def test_a_docker_pool_gives_its_containers_the_gpus_the_servers_network_the_state_volume_and_no_credential():
    template, job = _job("gpu-h100", ENV)
    assert job.image == "ghcr.io/acme/train:2026.11.23"
    assert job.networks == ["traingate"]
    assert job.volumes == ["traingate_state:/var/lib/traingate"]
    assert job.container_create_kwargs == {
        "device_requests": [{"Driver": "nvidia", "Count": -1, "Capabilities": [["gpu"]]}]}
    assert job.env == {"TRAINGATE_STATE_DIR": "/var/lib/traingate", "TRAINGATE_TRACKING_URI": "http://mlflow:5000",
                       "TRAINGATE_SECRET_BLOCKS": BLOCKS}
    text = json.dumps(template)
    assert "aws-secret-value-1" not in text and "pg-value-2" not in text
    # A deployment may still choose its own network (job variables override the pool's defaults).
    _, own = _job("gpu-h100", ENV, {"networks": ["other"]})
    assert own.networks == ["other"]


def test_a_cpu_docker_pool_requests_no_gpu_and_without_networks_set_keeps_dockers_default():
    env = {k: v for k, v in ENV.items() if k not in ("TRAINGATE_DOCKER_NETWORKS", "TRAINGATE_DOCKER_VOLUMES")}
    _, job = _job("cpu-docker", env)
    assert job.container_create_kwargs == {"device_requests": []}
    assert job.networks == [] and job.volumes == []


def test_a_malformed_secret_blocks_setting_is_refused_at_bootstrap_in_one_line():
    with pytest.raises(LocationError, match=r"^TRAINGATE_SECRET_BLOCKS = 'PGPASSWORD': entry 'PGPASSWORD' is not "
                                            r"VAR=block-name; write e.g\."):
        pool_locations("gpu-h100", {**ENV, "TRAINGATE_SECRET_BLOCKS": "PGPASSWORD"})


def test_credentials_go_to_secret_blocks_and_a_flow_run_loads_only_those_its_environment_lacks(prefect_harness,
                                                                                               monkeypatch):
    from flows.cli.pools import store_secret_blocks
    from flows.pipeline import load_secret_blocks

    lines = store_secret_blocks(ENV)
    assert lines == ["stored secret block tg-test-aws-secret (from $AWS_SECRET_ACCESS_KEY)",
                     "stored secret block tg-test-pgpassword (from $PGPASSWORD)"]
    # A container's flow run: the block names from its pool, no credential in its environment; a process
    # worker's flow run keeps what its worker has.
    monkeypatch.setenv("TRAINGATE_SECRET_BLOCKS", BLOCKS)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("PGPASSWORD", "the-workers-own")
    assert load_secret_blocks() == ["AWS_SECRET_ACCESS_KEY"]
    import os
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "aws-secret-value-1"
    assert os.environ["PGPASSWORD"] == "the-workers-own"


def test_a_missing_secret_block_or_credential_is_named_in_one_line(prefect_harness, monkeypatch):
    from flows.cli.pools import store_secret_blocks
    from flows.pipeline import load_secret_blocks

    monkeypatch.setenv("TRAINGATE_SECRET_BLOCKS", "MY_TOKEN=tg-test-never-stored")
    monkeypatch.delenv("MY_TOKEN", raising=False)
    with pytest.raises(LocationError, match=r"^TRAINGATE_SECRET_BLOCKS: Secret block 'tg-test-never-stored' \(for "
                                            r"\$MY_TOKEN\) cannot be loaded .*; store it with `traingate pools secrets`"):
        load_secret_blocks()
    with pytest.raises(CapacityError, match=r"^TRAINGATE_SECRET_BLOCKS: PGPASSWORD not set in this environment"):
        store_secret_blocks({"TRAINGATE_SECRET_BLOCKS": "PGPASSWORD=tg-test-pgpassword"})
