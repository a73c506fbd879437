"""A pytest run whose process starts before its arguments exist: the unit stage's, started beside the
data snapshot and the MLflow runs it waits for (the process: :mod:`traingate.launch.pytest_child`).

With an engine (a process pool's flow-run zygote, or the kept server's CLI engine) the process imports nothing
and the engine forks the run from torch, pytest and the contract tests' imports loaded long before; without one
it imports them itself while the flow does other work. What is read only at interpreter start
(``PYTHONPATH``, ``PYTHONDONTWRITEBYTECODE``) comes from the environment it was started with, so the caller
starts it with the run's environment and hands it the same one plus the per-run names.
"""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

from traingate.launch.proc import ProcessTree, ProcResult
from traingate.secrets import resolve_tree


class WarmPytest:
    """The parent's handle: started with :meth:`start`, run once with :meth:`run`, or dropped (:meth:`discard`,
    also when the handle is garbage-collected unused)."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self._finalizer = weakref.finalize(self, _discard, popen)

    @classmethod
    def start(cls, python: str, env: dict[str, str], preload: list[str], engine: str | None = None) -> WarmPytest:
        """``preload``: what the process imports ahead (or, forked by the engine at socket path ``engine``, what it
        imports only where that engine does not serve it)."""
        fork = ["--fork", engine] if engine else []
        return cls(
            subprocess.Popen(
                [python, "-m", "traingate.launch.pytest_child", *fork, *preload],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
                errors="replace",
                bufsize=1,
            )
        )

    def run(
        self,
        args: list[str],
        env: dict[str, str],
        cwd: str,
        log_path: Path,
        timeout_s: float | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> ProcResult:
        """``python -m pytest ARGS`` in ``cwd`` with ``env``, on the started interpreter (its output, timeout
        and stop as :func:`traingate.launch.proc.run`'s)."""
        self._finalizer.detach()
        assert self.popen.stdin is not None
        request = {"args": resolve_tree(args, env=env, field="command"), "env": env, "cwd": cwd}
        try:
            self.popen.stdin.write(json.dumps(request) + "\n")
            self.popen.stdin.close()
        except BrokenPipeError:
            pass  # it died while starting: its output and status say why
        return ProcessTree.adopt(self.popen, [sys.executable, "-m", "pytest", *args], log_path, on_line).wait(timeout_s)

    def discard(self) -> None:
        self._finalizer()


def _discard(popen: subprocess.Popen) -> None:
    """An unused warm interpreter (it has started nothing yet) is killed."""
    popen.kill()
    popen.wait()
    for pipe in (popen.stdin, popen.stdout):
        if pipe is not None:
            pipe.close()
