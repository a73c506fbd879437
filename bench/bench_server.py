"""The Prefect server a `traingate run` uses: the kept local server (warm) vs a temporary one, same invocation.

The same command, `traingate run examples/digits.yaml --until unit` (the cheapest stage that goes through the
whole CLI, the ladder flow and its tracking), in a fresh state dir, alternating between
``TRAINGATE_PREFECT_SERVER=kept`` (the server already started by a first run) and ``=temporary``. Besides the
runs' wall times, the server's own share: ``flows.local_server.ensure`` on the warm server (what a later command
pays: a lock, a record, two HTTP checks) and a cold start of each kind of server (Prefect's temporary server,
``SubprocessASGIServer.start``, and the kept one's ``prefect server start`` until it answers).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flows import local_server

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "digits.yaml"
REPEATS = 4

# Prefect's temporary server started the way `traingate run` starts it (its client's first use), timed alone.
TEMPORARY_START = """
import time
from prefect.server.api.server import SubprocessASGIServer
s = SubprocessASGIServer()
t = time.perf_counter()
s.start(timeout=300)
print(time.perf_counter() - t)
s.stop()
"""
KEPT_ENSURE = """
import sys, time
from pathlib import Path
from flows import local_server
t = time.perf_counter()
_, started = local_server.ensure(Path(sys.argv[1]))
print(time.perf_counter() - t, started)
"""


def _env(state: Path, mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "TRAINGATE_")) and k != "CI"}
    env.update(
        TRAINGATE_STATE_DIR=str(state),
        PREFECT_HOME=str(state / "prefect"),
        TRAINGATE_PREFECT_SERVER=mode,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    return env


def _run(state: Path, mode: str) -> float:
    cmd = [sys.executable, "-m", "flows.cli", "run", str(SPEC), "--until", "unit"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=_env(state, mode), capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    assert p.returncode == 0 and "pipeline PASSED" in p.stdout, (p.stdout + p.stderr)[-3000:]
    return wall


def _python(state: Path, mode: str, code: str, *args: str) -> list[str]:
    p = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=_env(state, mode),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split()


def main() -> str:
    with tempfile.TemporaryDirectory(prefix="tg-bench-server-") as tmp:
        state = Path(tmp) / "state"
        try:
            cold_kept = float(_python(state, "kept", KEPT_ENSURE, str(state))[0])
            first = _run(state, "kept")  # the flow, MLflow store and pytest caches warmed for both kinds alike
            kept: list[float] = []
            temporary: list[float] = []
            ensure: list[float] = []
            cold_temporary: list[float] = []
            for _ in range(REPEATS):
                kept.append(_run(state, "kept"))
                temporary.append(_run(state, "temporary"))
                warm, started = _python(state, "kept", KEPT_ENSURE, str(state))
                assert started == "False", "the kept server was not reused"
                ensure.append(float(warm))
                cold_temporary.append(float(_python(state, "temporary", TEMPORARY_START)[0]))
        finally:
            local_server.stop(state)
    k, t = statistics.median(kept), statistics.median(temporary)
    e, c = statistics.median(ensure), statistics.median(cold_temporary)
    gap = statistics.median(t_ - k_ for k_, t_ in zip(kept, temporary, strict=True))
    rows = [
        f"| measure (median of {REPEATS}) | kept server, warm | temporary server | temporary / kept |",
        "|---|---|---|---|",
        f"| `traingate run examples/digits.yaml --until unit`, wall | {k:.1f} s | {t:.1f} s | {t / k:.2f}x |",
        f"| temporary - kept, median over alternating pairs | | | {gap:+.1f} s |",
        f"| the server's part: warm `ensure` vs a temporary start | {e * 1000:.0f} ms | {c:.1f} s | {c / e:.0f}x |",
        "",
        f"Kept server's cold start (`prefect server start` until it answers with its auth string): {cold_kept:.1f} s; "
        f"the first `run` after it: {first:.1f} s. Runs alternate kept/temporary; "
        f"all: kept {', '.join(f'{x:.1f}' for x in kept)} s, temporary {', '.join(f'{x:.1f}' for x in temporary)} s; "
        f"load average at the end {os.getloadavg()[0]:.1f}.",
    ]
    return "\n".join(rows)
