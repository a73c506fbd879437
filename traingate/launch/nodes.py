"""A stage on several nodes: one torchrun agent per node, all stopped when one node is lost.

The supervisor launches ONE process tree per attempt. For a job on N nodes that tree is this
module's fan-out (``python -m traingate.launch.nodes``): it starts the same torchrun agent on every
node through a node launcher (how to run a command on node i: ``ip netns exec`` for namespaces on
this machine, a one-task ``srun --overlap`` step inside a Slurm allocation; see docs/multinode.md),
waits for them, and when one ends in failure (its host lost, its agent killed)
stops the others and exits as that one did. The supervisor then
relaunches every node from the latest checkpoint, as after any lost worker. torchrun's c10d
rendezvous joins the nodes; nothing here places, schedules or restarts anything: this is the
job ``srun --kill-on-bad-exit`` does on a Slurm allocation.

Which nodes: ``TRAINGATE_NODES``, set by whoever owns the hosts (a pool's job template, a test).
Node 0 hosts the rendezvous, so ``resources.rdzv_endpoint`` must be its address. Per node, the
agent gets torchrun's own environment options (``PET_LOCAL_ADDR``,
``PET_RDZV_ID``, ``PET_RDZV_CONF``) and the interface gloo binds to.

>>> node_environment(Node("tg-b", "10.77.0.2", "tgb0", ("ip", "netns", "exec", "tg-b")), 1, "r1.full.0")
{'PET_LOCAL_ADDR': '10.77.0.2', 'PET_RDZV_ID': 'r1.full.0', 'PET_RDZV_CONF': 'is_host=0', 'GLOO_SOCKET_IFNAME': 'tgb0'}
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from traingate.capacity import slurm_cli
from traingate.runtime import exitcodes
from traingate.settings import NODES_VAR  # "netns:NS0,NS1,...": node i is network namespace NSi on this machine
from traingate.spec import SpecError

POLL_S = 0.2
STOP_GRACE_S = 15.0  # a surviving agent's time to stop its workers before SIGKILL
_stopping: list[int] = []  # signals received: the supervisor is stopping the stage, no node was lost


@dataclass(frozen=True)
class Node:
    name: str  # the namespace (or host) as TRAINGATE_NODES names it
    addr: str  # where the other nodes reach it: its torchrun --local-addr
    ifname: str | None  # the interface gloo binds to (None: gloo's own choice)
    prefix: tuple[str, ...]  # the command that runs a command on this node


def netns_node(name: str) -> Node:
    """A network namespace on this machine as a node: its first global IPv4 address and interface.

    The filesystem and process table are shared with the supervisor: the stage directory is the
    shared store the ranks' heartbeats reach the supervisor through.
    """
    out = subprocess.run(
        ["ip", "-n", name, "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SpecError(
            f"{NODES_VAR}: namespace {name!r} cannot be read ({out.stderr.strip() or out.returncode}); "
            "create it first (`ip netns add NAME`, a veth with an address) or fix the name"
        )
    for line in out.stdout.splitlines():
        # "2: tga0    inet 10.77.0.1/24 scope global tga0\       valid_lft forever ..."
        fields = line.split()
        if "inet" in fields:
            return Node(
                name,
                fields[fields.index("inet") + 1].split("/")[0],
                fields[1].rstrip(":"),
                ("ip", "netns", "exec", name),
            )
    raise SpecError(
        f"{NODES_VAR}: namespace {name!r} has no global IPv4 address; give it one "
        f"(`ip -n {name} addr add 10.77.0.2/24 dev IF`) so the other nodes can reach it"
    )


def slurm_node(name: str) -> Node:
    """A node of the Slurm allocation this process runs in: its NodeAddr, the interface holding it (asked on
    the node), and a one-task ``srun --overlap`` step on it as the launcher (:mod:`traingate.capacity.slurm_cli`)."""
    addr = slurm_cli.node_addresses().get(name)
    if addr is None:
        raise SpecError(
            f"{NODES_VAR}: {name!r} is not a node of this Slurm cluster (scontrol show node); "
            "name the allocation's nodes (scontrol show hostnames $SLURM_JOB_NODELIST)"
        )
    return Node(name, addr, slurm_cli.interface_of(name, addr), slurm_cli.step_prefix(name))


LAUNCHERS = {"netns": netns_node, "slurm": slurm_node}


def parse_nodes(text: str | None, count: int) -> list[Node]:
    """The ``count`` nodes ``TRAINGATE_NODES`` names (``KIND:NAME,NAME,...``); node 0 first."""
    fix = f"set {NODES_VAR}=netns:NS0,NS1,... ({count} names; docs/multinode.md)"
    if not text:
        raise SpecError(f"resources.nodes = {count} needs {NODES_VAR} (where each node's agent runs); {fix}")
    kind, _, names = text.partition(":")
    if kind not in LAUNCHERS:
        raise SpecError(
            f"{NODES_VAR} = {text!r}: unknown launcher {kind!r}; use one of {', '.join(sorted(LAUNCHERS))} ({fix})"
        )
    listed = [n.strip() for n in names.split(",") if n.strip()]
    if len(listed) != count or len(set(listed)) != count:
        raise SpecError(
            f"{NODES_VAR} = {text!r}: names {len(set(listed))} distinct nodes but resources.nodes = {count}; {fix}"
        )
    return [LAUNCHERS[kind](n) for n in listed]


def check_rendezvous(nodes: list[Node], endpoint: str) -> None:
    """Node 0 hosts the c10d store (``is_host=1``): the endpoint must be its address."""
    host, _, port = endpoint.rpartition(":")
    if host.strip("[]") != nodes[0].addr:
        raise SpecError(
            f"resources.rdzv_endpoint = {endpoint!r}: node 0 ({nodes[0].name}) hosts the rendezvous "
            f"at {nodes[0].addr}; set resources.rdzv_endpoint={nodes[0].addr}:{port}"
        )


def node_environment(node: Node, rank: int, rdzv_id: str) -> dict[str, str]:
    """What the agent on ``node`` gets beyond the stage's environment (torchrun reads PET_* as its options)."""
    # No node rank: c10d ignores it and numbers the nodes in the order of their addresses.
    env = {
        "PET_LOCAL_ADDR": node.addr,
        "PET_RDZV_ID": rdzv_id,
        # Who hosts the rendezvous store is decided here, not by torchrun's hostname heuristic:
        # namespaces share one hostname, and cluster hosts often resolve theirs elsewhere.
        "PET_RDZV_CONF": f"is_host={int(rank == 0)}",
    }
    if node.ifname:
        env["GLOO_SOCKET_IFNAME"] = node.ifname
    return env


def fan_out_command(python: str, nodes: int, rdzv_id: str, rdzv_endpoint: str, agent: list[str]) -> list[str]:
    """The one command the supervisor launches for a multi-node attempt."""
    return [
        python,
        "-m",
        "traingate.launch.nodes",
        "--nodes",
        str(nodes),
        "--rdzv-id",
        rdzv_id,
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--",
        *agent,
    ]


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by signal {-rc} ({signal.Signals(-rc).name})"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def run(nodes: list[Node], agent: list[str], rdzv_id: str, env: Mapping[str, str]) -> int:
    """Start ``agent`` on every node; the first failure stops the rest. Returns the exit status to report."""
    procs: list[subprocess.Popen] = []
    for rank, node in enumerate(nodes):
        extra = node_environment(node, rank, rdzv_id)
        print(
            f"[launch_nodes] node {rank} ({node.name}, {node.addr}): {' '.join(node.prefix)} <agent> "
            f"{' '.join(f'{k}={v}' for k, v in extra.items())}",
            flush=True,
        )
        procs.append(subprocess.Popen([*node.prefix, *agent], env={**env, **extra}, stdin=subprocess.DEVNULL))
    failed: tuple[int, int] | None = None
    while failed is None and any(p.poll() is None for p in procs):
        for rank, p in enumerate(procs):
            if p.poll() not in (None, 0):
                failed = rank, p.returncode
                break
        else:
            time.sleep(POLL_S)
    if failed is None:
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if not bad:
            return 0
        failed = bad[0]
    rank, rc = failed
    if _stopping:
        print(f"[launch_nodes] stopping on request: node {rank} ({nodes[rank].name}) agent {_describe(rc)}", flush=True)
    else:
        print(
            f"[launch_nodes] node {rank} ({nodes[rank].name}) lost: its agent {_describe(rc)}; stopping the "
            "other nodes (the supervisor relaunches all of them from the latest checkpoint)",
            flush=True,
        )
    _stop([p for p in procs if p.poll() is None])
    return rc


def _stop(procs: list[subprocess.Popen]) -> None:
    # A survivor's workers are stuck on, or already failing in, a collective with the lost node:
    # SIGTERM lets its agent stop them; SIGKILL after the grace (the supervisor sweeps the orphans).
    for p in procs:
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_as(rc: int) -> None:
    """End this process the way the failed agent ended, so the supervisor reads the same evidence."""
    if rc < 0:
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m traingate.launch.nodes", description=__doc__.split("\n")[0])
    parser.add_argument("--rdzv-id", required=True)
    parser.add_argument("--rdzv-endpoint", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("agent", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    agent = args.agent[1:] if args.agent[:1] == ["--"] else args.agent
    try:
        nodes = parse_nodes(os.environ.get(NODES_VAR), args.nodes)
        check_rendezvous(nodes, args.rdzv_endpoint)
    except SpecError as e:
        print(f"[launch_nodes] {e}", file=sys.stderr, flush=True)
        sys.exit(exitcodes.USER_ERROR)
    # The supervisor's SIGTERM (preemption) reaches every agent here directly (same process group,
    # or forwarded by srun/ssh elsewhere); this process outlives it to report how the agents ended.
    signal.signal(signal.SIGTERM, lambda sig, _: _stopping.append(sig))
    signal.signal(signal.SIGINT, lambda sig, _: _stopping.append(sig))
    _exit_as(run(nodes, agent, args.rdzv_id, os.environ))


if __name__ == "__main__":
    main()
