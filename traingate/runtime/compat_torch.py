"""torch's private API: the only place traingate reaches past torchrun's public surface.

Written against ``torch==2.13.0`` (the pin in pyproject.toml); ``tests/test_compat.py`` fails when
the installed version or the behaviour relied on here changes, so a version bump is re-checked here
and nowhere else.

Why at all: traingate's torchrun agent (:mod:`traingate.runtime.agent`) decides for itself what a
SIGTERM means (torchrun offers no hook for it), and a one-node group's in-place restart should not
pay for the rendezvous bookkeeping torchrun does for many nodes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

from torch.distributed.elastic.multiprocessing import api as elastic_api
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

PINNED = "2.13.0"

SignalHandler = Callable[[int, FrameType | None], None]

torch_terminate_handler: SignalHandler = elastic_api._terminate_process_handler


def set_terminate_handler(handler: SignalHandler) -> None:
    """Make ``handler`` the SIGTERM/SIGINT handler torchrun installs each time it starts a group.

    torchrun registers it by this module-level name; the handler it replaces is
    :data:`torch_terminate_handler` (raises ``SignalException``: the agent shuts the group down).
    """
    elastic_api._terminate_process_handler = handler  # type: ignore[assignment]  # same signature, a plain callable


def _method_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up, as ``dynamic_rendezvous.get_method_name`` gives it."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def fast_one_node_rendezvous() -> None:
    """Make the c10d rendezvous of a one-node group (every in-place restart runs one) cost milliseconds.

    Two things in it are for many nodes and cost a one-node group's restart its time (measured on the
    2-core box, warm restarts, one ``term`` preemption):

    - every rendezvous event is named by ``get_method_name``, which calls ``inspect.stack()`` twice: each
      call reads the source of every frame and scans ``sys.modules`` (thousands of modules with torch
      loaded). 16 calls a rendezvous: 0.15-0.25 s of the agent's CPU. The frame's own name is the same
      name, read without the source.
    - the rendezvous of round 0 (the group's start and its first restart) sleeps a random 0-0.3 s "to skew
      the rendezvous attempts across the nodes": with one node there is nothing to skew against. The
      one-second wait between polls of a rendezvous still in progress is kept.

    Call it only in an agent whose group has one node.
    """
    dynamic_rendezvous.get_method_name = _method_name
    delay = dynamic_rendezvous._delay

    def no_jitter(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):  # a range is the start-up jitter; a number is a poll's wait
            delay(seconds)

    dynamic_rendezvous._delay = no_jitter
