"""The unit stage's pytest process: started before its arguments exist, it runs them as ``python -m pytest
ARGS`` would in the directory and environment handed to it later.

``python -m traingate.launch.pytest_child [--fork SOCKET] [MODULE ...]`` waits for one JSON line on stdin,
``{args, env, cwd}``; end of input before it (the flow stopped first, or its process is gone) ends it with
status 0 and no output.

- Without ``--fork`` it imports pytest and each MODULE first (for a built-in recipe: torch and the modules its
  contract tests import, 4-5 CPU-s), while the flow it belongs to does other work.
- With ``--fork SOCKET`` it imports nothing: it asks the engine at SOCKET (a process pool's flow-run zygote,
  ``flows.warm_engine``, or the kept server's CLI engine, ``flows.cli_engine``: both hold torch, pytest and the
  contract tests' imports already) to fork the run in its place (:mod:`traingate.runtime.handoff`: the fork
  takes this process's stdout and stderr, its exit status is this one's). Where no engine answers, or it
  refuses, this process imports and runs the tests itself.

The test modules themselves are never imported ahead: pytest imports them, rewriting their asserts. What an
interpreter reads only as it starts comes from the one that runs the tests: an engine refuses a request whose
``PYTHON*`` variables differ from its own, but ``PYTHONPATH`` and ``PYTHONDONTWRITEBYTECODE``, which a forked
run applies to its ``sys.path`` and ``sys.dont_write_bytecode``.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import socket
import sys
from pathlib import Path

from traingate.runtime import handoff

KIND = "pytest"  # the request key an engine forks a pytest run for
CODE_ROOT = Path(__file__).resolve().parents[2]  # the checkout: traingate/launch/ -> its root
# Read by an interpreter as it starts, applied to a forked one (:func:`forked`): an engine need not share them.
APPLIED = frozenset({"PYTHONDONTWRITEBYTECODE", "PYTHONPATH"})
# What a built-in recipe's contract tests import (test_recipe_contract.py's imports, not the module itself:
# pytest imports that, rewriting its asserts), and TorchDynamo: an optimizer's constructor imports it (about
# 1.9 s of CPU, the slowest part of the tests when it is not loaded ahead). An engine that forks pytest runs
# imports them too.
CONTRACT_PRELOAD = ["torch", "torch._dynamo", "yaml", "traingate.recipes", "traingate.runtime.rng", "traingate.spec"]
# A forked run's interpreter holds the engine's libraries, some of them pytest plugins (anyio, platformdirs), which
# pytest can no longer rewrite and warns about: their own asserts, not the tests'.
FORKED_ARGS = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine = None
    if argv[:1] == ["--fork"] and len(argv) > 1:
        engine, argv = argv[1], argv[2:]
    else:
        _preload(argv)
    line = sys.stdin.readline()
    if not line:
        return 0
    request = json.loads(line)
    if engine is None:
        return run(request)
    asked = {
        KIND: request["args"],
        "env": request["env"],
        "cwd": request["cwd"],
        "python": sys.executable,
        "code": str(CODE_ROOT),
    }
    return handoff.ask(engine, asked, lambda: _cold(argv, request))


def _cold(preload: list[str], request: dict) -> int:
    _preload(preload)
    return run(request)


def _preload(modules: list[str]) -> None:
    # Not pytest's plugins: pytest marks them for assert rewriting as it loads them, and warns about each
    # one already imported.
    # The imports make many objects and no garbage: no collection runs during them (0.1-0.5 of 2.6-2.8 CPU-s for
    # a built-in recipe's here), and frozen afterwards they stay out of the tests' own collections.
    gc.disable()
    for name in ["pytest", *modules]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a warm-up only: pytest imports it again, and reports what fails
            pass
    gc.freeze()
    gc.enable()


def run(request: dict) -> int:
    """``pytest.main(args)`` in the request's directory and environment, as ``python -m pytest ARGS`` would run
    there (the working directory first on ``sys.path``); pytest imported already."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.path[0] = request["cwd"]
    sys.argv = ["pytest", *request["args"]]
    return int(sys.modules["pytest"].main(request["args"]))


def forked(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In an engine's forked child, its own state let go of: take the asking process's place (its session, fds,
    environment, directory), run the tests and end with their exit status (:func:`handoff.finish`)."""
    engines = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    done = handoff.take_place(conn, request, fds, "pytest-entry-watch")
    handoff.std_streams()
    # As an interpreter started with the request's PYTHONPATH: its entries after the first one, the engine's gone.
    theirs = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:] = [*theirs, *(p for p in sys.path[1:] if p not in engines and p not in theirs)]
    handoff.run_and_finish(
        conn, done, lambda: run({"args": [*FORKED_ARGS, *request[KIND]], "env": request["env"], "cwd": request["cwd"]})
    )


def refusal(request: dict) -> str | None:
    """As an engine holding this checkout's code: why it does not fork the pytest run ``request`` asks for (None:
    it does)."""
    if request.get("python") != sys.executable or request.get("code") != str(CODE_ROOT):
        return f"the tests run {request.get('python')} on {request.get('code')}, not this engine's interpreter and code"
    if differ := handoff.differing_interpreter_vars(request["env"], APPLIED):
        return f"the tests' {differ} differ from the engine's (read at interpreter start)"
    return None


if __name__ == "__main__":
    sys.exit(main())
