"""A pytest run whose interpreter starts before its arguments exist: the unit stage's, started beside the
data snapshot and the MLflow runs it waits for.

``python -m traingate.launch.warm_pytest [MODULE ...]`` imports pytest and each MODULE (for a
built-in recipe: torch and the modules its contract tests import, about 2 s of CPU), then waits for one JSON line
on stdin, ``{args, env, cwd}``: it takes that environment and working directory and runs
``pytest.main(args)`` as ``python -m pytest ARGS`` would there (the working directory first on
``sys.path``). End of input before a request (the flow stopped first, or its process is gone) ends it
with status 0 and no output. The test modules themselves are not imported early: pytest imports them,
rewriting their asserts. What is read only at interpreter start (``PYTHONPATH``,
``PYTHONDONTWRITEBYTECODE``) comes from the environment it was started with, so the caller starts it
with the run's environment and hands it the same one plus the per-run names.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

from traingate.launch.proc import ProcessTree, ProcResult
from traingate.secrets import resolve_tree


def main(argv: list[str] | None = None) -> int:
    # Not pytest's plugins: pytest marks them for assert rewriting as it loads them, and warns about each
    # one already imported.
    # The imports make many objects and no garbage: no collection runs during them (0.1-0.5 of 2.6-2.8 CPU-s for
    # a built-in recipe's here), and frozen afterwards they stay out of the tests' own collections.
    gc.disable()
    for name in ["pytest", *(sys.argv[1:] if argv is None else argv)]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a warm-up only: pytest imports it again, and reports what fails
            pass
    gc.freeze()
    gc.enable()
    line = sys.stdin.readline()
    if not line:
        return 0
    request = json.loads(line)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]
    sys.argv = ["pytest", *request["args"]]
    return int(sys.modules["pytest"].main(request["args"]))


class WarmPytest:
    """The parent's handle: started with :meth:`start`, run once with :meth:`run`, or dropped (:meth:`discard`,
    also when the handle is garbage-collected unused)."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self._finalizer = weakref.finalize(self, _discard, popen)

    @classmethod
    def start(cls, python: str, env: dict[str, str], preload: list[str]) -> WarmPytest:
        return cls(
            subprocess.Popen(
                [python, "-m", "traingate.launch.warm_pytest", *preload],
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


if __name__ == "__main__":
    sys.exit(main())
