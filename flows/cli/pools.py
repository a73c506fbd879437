"""`traingate pools bootstrap POOLS.yaml`: make the Prefect server carry the capacity config.

Idempotent; prints one line per thing it created or changed and says when nothing changed.
Per pool: the work pool (process, docker or kubernetes; GPU pools' templates request the GPUs and
run the pinned training image), one work queue per priority class (Prefect queue priority 1 is
served first, so the highest class gets 1); and the config itself as the Prefect Variable
``traingate-pools``, from which every job reads its rules (``tasks/slots.py``). A local pool's slots,
quotas and entitlements are held by the pool's one authority (``traingate.capacity.authority``), which
the first job on the pool starts; a Slurm pool's by Slurm.

Each pool's job template carries the locations of the bootstrap's environment (state directory,
tracking, artifact, checkpoint and Optuna stores: ``traingate.settings.pool_locations``) as the
default environment of every flow run on it, so no run falls back to the directory its code is in.
A pool without a state directory is refused.

`traingate pools show POOLS.yaml` lists each pool's nodes (a Slurm pool's from sinfo: state, GPUs
in use, a drain's reason); `traingate pools drain NODE --reason R` / `traingate pools resume NODE`
take a Slurm node out of service and back (``scontrol update nodename=N state=drain|resume``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Mapping
from typing import Any

from prefect import get_client
from prefect.blocks.system import Secret
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL
from prefect.workers.process import ProcessWorker
from prefect_docker.worker import DockerWorker
from pydantic import SecretStr

from flows.warm_engine import ENGINE_COMMAND
from tasks import slots
from traingate.capacity import slurm, slurm_cli
from traingate.capacity.pools import CapacityConfig, CapacityError, Engine, PoolConfig, load_config
from traingate.capacity.slurm import SlurmError
from traingate.settings import (
    DOCKER_NETWORKS_VAR,
    DOCKER_VOLUMES_VAR,
    IMAGE_VAR,
    SECRET_BLOCKS_VAR,
    LocationError,
    pool_locations,
    secret_blocks,
)


def main(args: argparse.Namespace) -> int:
    try:
        if args.action in ("show", "drain", "resume"):
            print("\n".join(_nodes(args)))
            return 0
        if args.action == "secrets":
            _require_server("secret blocks are stored")
            changes = store_secret_blocks()
        else:
            cfg = load_config(args.config)
            _require_server()
            changes = bootstrap(cfg, image=args.image)
    except (CapacityError, LocationError, SlurmError) as e:
        print(f"traingate pools: {e}", file=sys.stderr)
        return 2
    for line in changes or ["nothing changed: the server already carries this config"]:
        print(line)
    return 0


def _nodes(args: argparse.Namespace) -> list[str]:
    """`pools show`: every pool's nodes; `pools drain` / `pools resume`: a Slurm node's state, then its line."""
    if args.action != "show":
        known = [v.name for v in slurm.nodes(slurm_cli.sinfo())]
        if args.node not in known:
            raise CapacityError(
                f"node {args.node!r} is not a node of this Slurm cluster ($SLURM_CONF); use one of {', '.join(known)}"
            )
        reason = f"traingate:{args.reason}" if args.action == "drain" else None
        slurm_cli.set_node_state(args.node, args.action, reason)
        view = next((v for v in slurm.nodes(slurm_cli.sinfo()) if v.name == args.node), None)
        return [
            f"node {args.node}: {view.state if view else 'unknown'}"
            + (f" ({view.reason})" if view and view.reason else "")
        ]
    cfg = load_config(args.config)
    if args.pool and args.pool not in cfg.pools:
        raise CapacityError(f"--pool {args.pool!r}: not a pool; use one of {sorted(cfg.pools)}")
    shown = {n: p for n, p in cfg.pools.items() if not args.pool or n == args.pool}
    views = slurm.nodes(slurm_cli.sinfo()) if any(p.engine == Engine.SLURM for p in shown.values()) else []
    out: list[str] = []
    for name, pool in shown.items():
        if pool.engine == Engine.SLURM:
            assert pool.slurm is not None, "a Slurm pool has its slurm section (the config validates it)"
            out += slurm.node_lines(name, pool.slurm, [v for v in views if pool.slurm.partition in v.partitions])
        else:
            out.append(
                f"pool {name} (local engine): {pool.nodes} node(s) x {pool.gpus_per_node} slots = "
                f"{pool.capacity} slots; `traingate queue --pool {name}` shows who holds them"
            )
    if any(p.engine == Engine.SLURM for p in shown.values()):
        mismatch = slurm.half_life_mismatch(slurm_cli.show_config(), cfg.scheduling.half_life_h)
        if mismatch:
            out.append(mismatch)
    return out


def store_secret_blocks(env: Mapping[str, str] | None = None) -> list[str]:
    """Each ``VAR=block`` of ``TRAINGATE_SECRET_BLOCKS`` as a Prefect Secret block holding ``$VAR`` of ``env``.

    A flow-run container does not inherit its worker's environment, and a job variable is visible to
    everyone who reads the deployment: the credentials go to the server's Secret blocks once, from the
    one place that holds them (the stack's secrets), and flow runs load them by name (flows/pipeline.py)."""

    env = os.environ if env is None else env
    wanted = secret_blocks(env.get(SECRET_BLOCKS_VAR))
    if not wanted:
        raise CapacityError(
            f"{SECRET_BLOCKS_VAR} is not set: name the credentials to store, e.g. "
            "AWS_SECRET_ACCESS_KEY=traingate-aws-secret-access-key,PGPASSWORD=traingate-pgpassword"
        )
    missing = [var for var in wanted if not env.get(var)]
    if missing:
        raise CapacityError(
            f"{SECRET_BLOCKS_VAR}: {', '.join(missing)} not set in this environment; run "
            "`traingate pools secrets` where the credentials are set"
        )
    changes = []
    for var, block in wanted.items():
        Secret(value=SecretStr(env[var])).save(block, overwrite=True)
        changes.append(f"stored secret block {block} (from ${var})")
    return changes


def _require_server(what: str = "pools are created") -> None:
    if not PREFECT_API_URL.value():
        raise CapacityError(
            f"PREFECT_API_URL is not set: {what} on the server your workers use; "
            "set it (e.g. http://127.0.0.1:4200/api)"
        )


def queue_priorities(cfg: CapacityConfig) -> dict[str, int]:
    """Work queue priority per class: 1 for the highest class (Prefect serves 1 first).

    >>> from traingate.capacity.pools import parse_config
    >>> queue_priorities(parse_config({"pools": {"p": {"gpus_per_node": 1, "nodes": 1,
    ...     "price_per_gpu_hour": 0, "worker": "process"}}}))
    {'urgent': 1, 'production': 2, 'research': 3}
    """
    ranked = sorted(cfg.priority_classes, key=cfg.rank)
    return {name: i + 1 for i, name in enumerate(ranked)}


def job_template(
    pool: PoolConfig,
    image: str | None,
    pool_name: str,
    locations: dict[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The pool's base job template; ``locations`` become the default environment of its flow runs
    (a deployment's ``env`` job variables are merged over them by Prefect, not instead of them).
    ``env``: the bootstrap's environment (a docker pool's networks and volumes)."""
    base = copy.deepcopy(_template(pool, image, pool_name, env))
    if locations:
        base["variables"]["properties"]["env"]["default"] = dict(locations)
    return base


def _template(
    pool: PoolConfig, image: str | None, pool_name: str, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    env = os.environ if env is None else env
    if pool.worker == "process":
        base = ProcessWorker.get_default_base_job_template()
        # A flow run forked from the worker's pre-imported zygote when its wrapper started one, else (no
        # zygote) exactly Prefect's own `python -m prefect.engine`: flows/warm_engine.py.
        base["variables"]["properties"]["command"]["default"] = ENGINE_COMMAND
        return base
    if not image:
        raise CapacityError(
            f"pools.{pool_name}.worker = {pool.worker}: a container pool needs the training image; "
            f"pass --image or set {IMAGE_VAR} (a pinned tag, not latest)"
        )
    if image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1]:
        raise CapacityError(f"--image {image!r}: pin a tag or digest (not latest), so every node runs the same code")
    if pool.worker == "docker":
        base = copy.deepcopy(DockerWorker.get_default_base_job_template())
        props = base["variables"]["properties"]
        props["image"]["default"] = image
        # prefect-docker passes container_create_kwargs to docker's create: the node's GPUs.
        props["container_create_kwargs"]["default"] = {
            "device_requests": [{"Driver": "nvidia", "Count": -1, "Capabilities": [["gpu"]]}] if pool.gpu else []
        }
        # A flow-run container reaches the servers only on their network, and keeps state on the pool's volume.
        for var, key in ((DOCKER_NETWORKS_VAR, "networks"), (DOCKER_VOLUMES_VAR, "volumes")):
            listed = [x.strip() for x in env.get(var, "").split(",") if x.strip()]
            if listed:
                props[key]["default"] = listed
        return base
    base = copy.deepcopy(ProcessWorker.get_default_base_job_template())
    props = base["variables"]["properties"]
    props["image"] = {"type": "string", "title": "Image", "default": image}
    base["job_configuration"]["image"] = "{{ image }}"
    # kubernetes
    props["job_manifest_gpu_limit"] = {
        "type": "integer",
        "default": pool.gpus_per_node if pool.gpu else 0,
        "title": "nvidia.com/gpu per pod",
    }
    base["job_configuration"]["job_manifest"] = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "prefect-job",
                            "image": "{{ image }}",
                            "env": "{{ env }}",
                            "resources": {"limits": {"nvidia.com/gpu": "{{ job_manifest_gpu_limit }}"}},
                        }
                    ],
                }
            }
        },
    }
    return base


def bootstrap(cfg: CapacityConfig, image: str | None = None, env: dict[str, str] | None = None) -> list[str]:
    """``env``: where the pools' locations come from (default: this process's environment)."""

    changes: list[str] = []
    prio = queue_priorities(cfg)
    locations = {name: pool_locations(name, env) for name in cfg.pools}  # every pool refused before any is made
    with get_client(sync_client=True) as c:
        for name, pool in cfg.pools.items():
            template = job_template(pool, image, name, locations[name], env)
            try:
                wp = c.read_work_pool(name)
            except ObjectNotFound:
                c.create_work_pool(
                    WorkPoolCreate(
                        name=name,
                        type=pool.worker,
                        base_job_template=template,
                        description=f"{pool.gpu or 'CPU'} x {pool.gpus_per_node} x {pool.nodes}",
                    )
                )
                changes.append(f"created work pool {name} ({pool.worker})")
            else:
                if wp.type != pool.worker:
                    raise CapacityError(
                        f"pools.{name}.worker = {pool.worker}: the server's work pool {name} is of type "
                        f"{wp.type}; delete it (prefect work-pool delete {name}) or use its type"
                    )
                if wp.base_job_template != template:
                    c.update_work_pool(name, WorkPoolUpdate(base_job_template=template))
                    changes.append(f"updated the job template of work pool {name}")
            queues = {q.name: q for q in c.read_work_queues(work_pool_name=name)}
            for cls, p in prio.items():
                if cls not in queues:
                    c.create_work_queue(name=cls, priority=p, work_pool_name=name)
                    changes.append(f"created work queue {name}/{cls} (priority {p})")
                elif queues[cls].priority != p:
                    c.update_work_queue(queues[cls].id, priority=p)
                    changes.append(f"work queue {name}/{cls}: priority {queues[cls].priority} -> {p}")
        value = cfg.model_dump(mode="json")
        var = c.read_variable_by_name(slots.CONFIG_VAR)
        if var is None or var.value != value:
            slots.put_variable(c, slots.CONFIG_VAR, value)
            changes.append(
                f"{'stored' if var is None else 'updated'} the capacity config (variable {slots.CONFIG_VAR})"
            )
    return changes
