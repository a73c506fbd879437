"""The local engine's queue under load: N jobs waiting on a one-slot pool (N = 10, 50, 200).

A real `prefect server start` carries the capacity config (`traingate pools bootstrap`'s Variable); each
waiting job reads it once, as `tasks/slots.py:for_job` does, and then waits on its own connection to the
pool's authority (`python -m traingate.capacity.authority`, a separate process). Jobs are threads of this
process, each with its own socket; a job holds the slot for HOLD_S and releases it. Reported per N:

- failed jobs (an exception in a job, or a job never admitted);
- max over-booking: the most jobs holding the one slot at once beyond 1, counted by the jobs themselves
  (incremented when admitted, decremented before the release);
- release -> next admission: from the holder's release call to the next job's admission, mean and max;
- policy order: every production job admitted before every research job, and each team's jobs of a class in
  submission order (every job was queued before the first release);
- CPU while N jobs wait and nothing changes (WAIT_S): the Prefect server's and the authority's, in % of one core.

docs/benchmarks.md compares these with a design where each waiter is a process polling Prefect Variables
(100 waiting: 105 requests/s and 74% of a core on the server, admission 17 s mean / 48 s max after a
release, 32 of 100 jobs failed on HTTP 503; 200 waiting: 124 failed and one double booking).
"""

from __future__ import annotations

import contextvars
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' `prefect server` helper

from tgtest import prefect_server  # noqa: E402

SIZES = tuple(int(n) for n in os.environ.get("TRAINGATE_BENCH_QUEUE_SIZES", "10,50,200").split(","))
HOLD_S = 0.05
WAIT_S = 10.0
POOL = "one-slot"
TEAMS = ("vision", "speech", "language", "recsys")
POOLS = {"pools": {POOL: {"gpus_per_node": 1, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}}}


def _cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of a process and its children (a `prefect server` runs its API in a child)."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _server_process(port_url: str) -> psutil.Process:
    port = int(port_url.rsplit(":", 1)[1].split("/")[0])
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid)
    raise RuntimeError(f"no process listens on port {port}")


def _one(n: int, tmp: Path, url: str) -> dict[str, float | int | str]:
    from prefect import get_client

    from tasks import slots
    from traingate.capacity.authority import paths
    from traingate.capacity.channel import Seat, start_authority, write_config
    from traingate.capacity.queue import Entry

    state = tmp / f"state-{n}"
    cfg_var = slots.CONFIG_VAR
    with get_client(sync_client=True) as c:
        write_config(state, POOL, slots.read_config(c))
    start_authority(state, POOL)
    lock = paths(state, POOL)["lock"]
    deadline = time.monotonic() + 30
    while not paths(state, POOL)["sock"].exists():
        assert time.monotonic() < deadline, "the authority did not start"
        time.sleep(0.05)
    authority = psutil.Process(int(lock.read_text()))
    holding = [0]
    peak = [0]
    admitted: list[tuple[str, float]] = []
    errors: list[str] = []
    go = threading.Lock()
    seats: dict[str, Seat] = {}
    queued = threading.Semaphore(0)

    def job(i: int) -> None:
        try:
            with get_client(sync_client=True) as c:  # as for_job: the config, once, from the server
                cfg = slots.read_config(c)
            assert cfg is not None, f"no {cfg_var} on the server"
            write_config(state, POOL, cfg)
            prio = "production" if i % 3 == 0 else "research"
            e = Entry(f"j{i:03d}-full", f"j{i:03d}", "full", TEAMS[i % len(TEAMS)], prio, POOL, 1, time.time())
            seat = Seat(state, e, lambda _: None)
            seats[e.job_id] = seat
            queued.release()
            if seat.wait(lambda: None) is not None:
                errors.append(f"{e.job_id}: stopped waiting")
                return
            with go:
                holding[0] += 1
                peak[0] = max(peak[0], holding[0])
                admitted.append((e.job_id, time.monotonic()))
            time.sleep(HOLD_S)
            with go:
                holding[0] -= 1
                released.append(time.monotonic())
            seat.release()
        except Exception as ex:  # noqa: BLE001 - counted as a failed job
            errors.append(f"j{i}: {ex!r}")

    released: list[float] = []
    # The first job takes the slot; the rest queue behind it.
    first = Seat(state, Entry("holder-full", "holder", "full", "ops", "research", POOL, 1, time.time()), print)
    assert first.wait(lambda: None) is None
    threads = []
    for i in range(n):
        # In this context: Prefect's settings (which server) are context variables, not inherited by threads.
        t = threading.Thread(target=contextvars.copy_context().run, args=(job, i), daemon=True)
        t.start()
        threads.append(t)
        queued.acquire()
        time.sleep(0.01)  # distinct submission times: the order within a team is the arrival order
    recs = paths(state, POOL)["records"]
    while sum(1 for r in json.loads(recs.read_text())["records"] if r["kind"] == "entry") < n + 1:
        time.sleep(0.05)
    server = _server_process(url)
    s0, a0, t0 = _cpu_s(server), _cpu_s(authority), time.monotonic()
    time.sleep(WAIT_S)
    dt = time.monotonic() - t0
    server_pct, authority_pct = 100 * (_cpu_s(server) - s0) / dt, 100 * (_cpu_s(authority) - a0) / dt
    with go:
        released.append(time.monotonic())
    first.release()
    for t in threads:
        t.join(timeout=max(60.0, n * 1.0))
    authority.kill()  # it would exit by itself after a minute idle
    lat = [a[1] - r for a, r in zip(admitted, released, strict=False)]
    order = [j for j, _ in admitted]
    prio = {f"j{i:03d}-full": ("production" if i % 3 == 0 else "research") for i in range(n)}
    team = {f"j{i:03d}-full": TEAMS[i % len(TEAMS)] for i in range(n)}
    classes_ok = all(prio[a] == "production" or prio[b] == "research" for a, b in zip(order, order[1:], strict=False))
    in_team = all(
        [j for j in order if (prio[j], team[j]) == k] == sorted(j for j in order if (prio[j], team[j]) == k)
        for k in {(prio[j], team[j]) for j in order}
    )
    failed = len(errors) + (n - len(admitted))
    return {
        "n": n,
        "failed": failed,
        "overbooked": max(0, peak[0] - 1),
        "lat_mean": statistics.fmean(lat) if lat else float("nan"),
        "lat_max": max(lat) if lat else float("nan"),
        "order": "yes" if classes_ok and in_team and len(order) == n else "NO",
        "server_pct": server_pct,
        "authority_pct": authority_pct,
        "errors": "; ".join(errors[:3]),
    }


def main() -> str:
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-queue-"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks import slots
    from traingate.capacity.pools import parse_config

    load0 = os.getloadavg()
    rows = []
    with prefect_server(tmp) as started, temporary_settings(updates={PREFECT_API_URL: started["url"]}):
        url = started["url"]
        with get_client(sync_client=True) as c:
            slots.put_variable(c, slots.CONFIG_VAR, parse_config(POOLS).model_dump(mode="json"))
        server = _server_process(url)
        s0, t0 = _cpu_s(server), time.monotonic()
        time.sleep(WAIT_S)
        idle_pct = 100 * (_cpu_s(server) - s0) / (time.monotonic() - t0)
        for n in SIZES:
            rows.append(_one(n, tmp, url))
    load1 = os.getloadavg()
    out = [
        f"One-slot local pool, N jobs waiting (threads, one socket each) on its authority; a real `prefect server` "
        f"carries the config. Each job holds the slot {HOLD_S * 1000:.0f} ms. CPU measured over {WAIT_S:.0f} s of "
        f"waiting with nothing changing. {os.cpu_count()} CPUs, load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after. The Prefect server with no job at all: {idle_pct:.1f}% of a core.",
        "",
        "| waiting jobs | failed | max over-booking | release -> next admission, mean / max | policy order | "
        "Prefect server CPU while waiting | authority CPU while waiting |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['n']} | {r['failed']} | {r['overbooked']} | {1000 * float(r['lat_mean']):.1f} ms / "
            f"{1000 * float(r['lat_max']):.1f} ms | {r['order']} | {float(r['server_pct']):.1f}% of a core | "
            f"{float(r['authority_pct']):.1f}% of a core |"
        )
    errs = [f"N={r['n']}: {r['errors']}" for r in rows if r["errors"]]
    if errs:
        out += ["", "Errors: " + " / ".join(errs)]
    return "\n".join(out)
