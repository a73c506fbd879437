"""Two "hosts" on one machine: network namespaces joined by a veth pair, each with its own address.

They share the filesystem and process table with the test (the stage directory stands in for the
shared store a real cluster needs: heartbeats, job file, checkpoints). Creating them needs root
and iproute2; without either the tests are skipped, saying which.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterator

import pytest


@dataclass(frozen=True)
class Hosts:
    a: str          # namespace of node 0 (it hosts the rendezvous)
    b: str          # namespace of node 1
    addr_a: str
    addr_b: str

    @property
    def nodes_var(self) -> str:
        return f"netns:{self.a},{self.b}"

    def pids(self, ns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True).stdout
        return [int(p) for p in out.split()]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = str(os.getpid() % 100000)   # another session's namespaces keep their names
    h = Hosts(f"tg-a{tag}", f"tg-b{tag}", "10.77.0.1", "10.77.0.2")
    veth_a, veth_b = f"tga{tag}", f"tgb{tag}"
    steps = [("netns", "add", h.a), ("netns", "add", h.b),
             ("link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
             ("link", "set", veth_a, "netns", h.a), ("link", "set", veth_b, "netns", h.b),
             ("-n", h.a, "addr", "add", f"{h.addr_a}/24", "dev", veth_a),
             ("-n", h.b, "addr", "add", f"{h.addr_b}/24", "dev", veth_b),
             ("-n", h.a, "link", "set", veth_a, "up"), ("-n", h.b, "link", "set", veth_b, "up"),
             ("-n", h.a, "link", "set", "lo", "up"), ("-n", h.b, "link", "set", "lo", "up")]
    try:
        for i, step in enumerate(steps):
            r = _ip(*step)
            if r.returncode != 0:
                if i == 0 and "Operation not permitted" in r.stderr:
                    pytest.skip(f"cannot create network namespaces here: {r.stderr.strip()}")
                raise RuntimeError(f"ip {' '.join(step)}: {r.stderr.strip()}")
        yield h
    finally:
        for ns in (h.a, h.b):
            _ip("netns", "del", ns)   # takes its end of the veth pair, and so the pair, with it
