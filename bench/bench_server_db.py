"""`python -m bench server_db`: what a command pays to start Prefect's temporary server on a new database,
with the database cache cold (an empty TRAINGATE_PREFECT_DB_CACHE: the server migrates its own, and its
snapshot is cached) against warm (a copy of the cached database, no migrations, no block registration).

Each start is what `traingate run`, `resume`, `sweep`, `ci` and `retrain` do before their flow
(flows.cli.run._start_prefect_server_shielded) and a client writing one flow, in a process of its own with a
fresh PREFECT_HOME; measured: CPU-s of that process and every process it reaped (the server included, which
it stops at exit), and wall time. Arms alternate, so load drifts hit both.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIRS = int(os.environ.get("BENCH_PAIRS", "3"))
START = """
from flows.cli.run import _start_prefect_server_shielded
_start_prefect_server_shielded()
from prefect import get_client
with get_client(sync_client=True) as client:
    client.create_flow_from_name("bench-server-db")
"""


def _start(home: Path, cache: Path) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        TRAINGATE_STATE_DIR=str(home / "state"),
        TRAINGATE_PREFECT_SERVER="temporary",
        TRAINGATE_PREFECT_DB_CACHE=str(cache),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", START], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"the start failed: {p.stderr[-2000:]}")
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), wall


def main() -> str:
    rows: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    loads = []
    with tempfile.TemporaryDirectory(prefix="bench-server-db-") as tmp:
        base = Path(tmp)
        warm = base / "warm-cache"
        _start(base / "prime", warm)  # fills the warm cache
        for i in range(PAIRS):
            loads.append(os.getloadavg()[0])
            rows["cold"].append(_start(base / f"cold-{i}", base / f"cold-cache-{i}"))
            rows["warm"].append(_start(base / f"warm-{i}", warm))
            shutil.rmtree(base / f"cold-{i}", ignore_errors=True)
    cold_cpu, warm_cpu = (statistics.median(c for c, _ in rows[k]) for k in ("cold", "warm"))
    cold_wall, warm_wall = (statistics.median(w for _, w in rows[k]) for k in ("cold", "warm"))
    return "\n".join(
        [
            f"| measure (median of {PAIRS}, load {min(loads):.0f}-{max(loads):.0f}) | cold cache | warm cache "
            "| warm / cold |",
            "|---|---|---|---|",
            f"| CPU-s, the command and its server | {cold_cpu:.1f} | {warm_cpu:.1f} | {warm_cpu / cold_cpu:.2f} |",
            f"| wall, s | {cold_wall:.1f} | {warm_wall:.1f} | {warm_wall / cold_wall:.2f} |",
            "",
            "single runs (CPU-s/wall s): cold "
            + ", ".join(f"{c:.1f}/{w:.0f}" for c, w in rows["cold"])
            + "; warm "
            + ", ".join(f"{c:.1f}/{w:.0f}" for c, w in rows["warm"]),
        ]
    )
