"""Fair-share usage is folded in by the pool's one authority, inside its lock: jobs that give their slots
back at the same moment each add their held GPU-time to their team's usage, and none is lost (a
read-modify-write of the usage by each job would keep only the last writer's)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from traingate.capacity import records
from traingate.capacity.authority import paths
from traingate.capacity.channel import Seat, write_config
from traingate.capacity.pools import parse_config
from traingate.capacity.queue import RUNNING, Entry

JOBS = 6  # three per team


@pytest.fixture
def state(tmp_path):
    """A state directory of this test's own; the authority the first job starts in it is stopped afterwards."""
    yield tmp_path
    lock = paths(tmp_path, "p")["lock"]
    pid = int(lock.read_text() or 0) if lock.exists() else 0
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _running(state) -> dict[str, Entry]:
    got = records.read_pool(state, "p").of(records.ENTRY)
    return {e.job_id: e for e in (Entry.from_json(v["entry"]) for v in got.values()) if e.state == RUNNING}


def test_concurrent_releases_each_add_their_held_time_to_their_teams_usage(state):
    # A half-life of 1000 hours: over these seconds, usage is GPU-hours held, undecayed to 1 part in a million.
    write_config(state, "p", parse_config({
        "pools": {"p": {"gpus_per_node": JOBS, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}},
        "scheduling": {"half_life_h": 1000}}))
    seats = [Seat(state, Entry(f"j{i}-full", f"j{i}", "full", "ab"[i % 2], "research", "p", 1, submit_s=time.time()),
                  say=lambda m: None) for i in range(JOBS)]
    for seat in seats:
        assert seat.wait(lambda: None) is None  # all fit at once: each is admitted
    started = {job: e.started_s for job, e in _running(state).items()}
    assert len(started) == JOBS and all(started.values()), started
    time.sleep(2.0)

    go = threading.Barrier(JOBS)
    ended: dict[str, float] = {}

    def release(seat: Seat) -> None:
        go.wait()
        seat.release(kind="full", held_s=1.0)
        ended[seat.entry.job_id] = time.time()

    threads = [threading.Thread(target=release, args=(s,)) for s in seats]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    deadline = time.monotonic() + 20
    while _running(state) and time.monotonic() < deadline:  # the authority writes its records after it replies
        time.sleep(0.1)
    usage = records.read_pool(state, "p").of(records.USAGE)
    for team in "ab":
        jobs = [s.entry.job_id for s in seats if s.entry.team == team]
        low = sum(t0 - started[j] for j in jobs) / 3600.0
        high = sum(ended[j] - started[j] for j in jobs) / 3600.0
        # every job's interval is in its team's usage: one lost release would leave a third of it out
        assert low * (1 - 1e-6) <= usage[team][0] <= high * (1 + 1e-6), (team, usage, low, high)
