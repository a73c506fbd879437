"""Constants and helpers shared by tests (import as `from tgtest import ...`; conftest
module names collide between test directories, so nothing is imported from conftest)."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY_DIGITS = """
identity: {experiment: tests, owner: tester, team: platform, purpose: exercise the ladder in tests}
recipe: {name: digits-cnn, params: {channels: 8, hidden: 32}}
optim: {lr: 0.05, batch_size: 16, seed: 0}
resources: {work_pool: cpu-local, procs_per_node: 2}
stages:
  smoke: {max_steps: 4, max_samples: 64}
  canary: {max_steps: 20}
  full: {max_steps: 16}
gates:
  canary:
    rules:
      - {metric: loss_decrease_fraction, op: ">=", value: 0.05}
      - {metric: nonfinite_steps, op: "==", value: 0}
checkpoint: {every_steps: 5}
tracking: {log_every: 2}
"""
