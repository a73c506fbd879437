"""The local pool's one authority: admission in policy order within a second of a release, signed records
(a forged one is ignored and reported), entitlements checked against the connection's OS user, and no
double booking when the authority and a holder are killed mid-lease. Real processes and sockets; the
jobs are threads or small subprocesses holding slots without training."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from tgtest import PYTHON

from traingate.capacity import records
from traingate.capacity.authority import paths, stop
from traingate.capacity.channel import AuthorityError, Seat, write_config
from traingate.capacity.pools import parse_config
from traingate.capacity.queue import RUNNING, Entry


def _cfg(gpus: int = 1, **extra):
    return parse_config(
        {"pools": {"p": {"gpus_per_node": gpus, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}}, **extra}
    )


def _entry(name: str, team: str = "a", priority: str = "research", slots: int = 1) -> Entry:
    return Entry(f"{name}-full", name, "full", team, priority, "p", slots, submit_s=time.time())


def _held(state: Path) -> list[Entry]:
    got = records.read_pool(state, "p")
    return [e for e in (Entry.from_json(v["entry"]) for v in got.of(records.ENTRY).values()) if e.state == RUNNING]


def _start(state: Path, lease_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "traingate.capacity.authority",
            "--pool",
            "p",
            "--state-dir",
            str(state),
            "--lease-s",
            str(lease_s),
            "--idle-exit-s",
            "30",
        ],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not paths(state, "p")["sock"].exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    return proc


@pytest.fixture
def state(tmp_path):
    """A state directory of this test's own; every authority started in it is stopped afterwards."""
    yield tmp_path
    stop(tmp_path, "p")


def _waiter(seat: Seat, admitted: dict[str, float]) -> threading.Thread:
    def run():
        if seat.wait(lambda: None) is None:
            admitted[seat.entry.job_id] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_each_release_admits_the_next_job_in_policy_order_within_a_second(state):
    write_config(state, "p", _cfg())
    holder = Seat(state, _entry("h", team="z"), print)
    assert holder.wait(lambda: None) is None
    # Arrival order: research before production; teams distinct so fair share leaves class, then submission.
    arrivals = [("r1", "a", "research"), ("p1", "b", "production"), ("r2", "c", "research"), ("p2", "d", "production")]
    seats = {}
    admitted: dict[str, float] = {}
    for name, team, prio in arrivals:
        seats[name] = Seat(state, _entry(name, team, prio), lambda _: None)
        _waiter(seats[name], admitted)
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while (
        len([e for e in json.loads(paths(state, "p")["records"].read_text())["records"] if e["kind"] == "entry"]) < 5
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    order, latencies, current = [], [], holder
    for _ in arrivals:
        released = time.monotonic()
        current.release()
        while not (new := [j for j in admitted if j not in order]) and time.monotonic() - released < 10:
            time.sleep(0.005)
        assert len(new) == 1, (new, order)
        order.append(new[0])
        latencies.append(admitted[new[0]] - released)
        current = seats[new[0].removesuffix("-full")]
        assert [e.job_id for e in _held(state)] == [new[0]]  # one holder at a time on the one-slot pool
    current.release()
    assert order == ["p1-full", "p2-full", "r1-full", "r2-full"]
    assert max(latencies) < 1.0, latencies


def test_a_record_not_signed_by_the_authority_is_ignored_and_reported(state, capsys):
    from flows.cli.queue import local_queue, render

    write_config(state, "p", _cfg())
    proc = _start(state, lease_s=20)
    holder = Seat(state, _entry("h"), print)
    assert holder.wait(lambda: None) is None
    proc.kill()
    proc.wait()
    # Someone who is not the authority adds a job that holds the pool and a preemption of the real holder.
    path = paths(state, "p")["records"]
    tree = json.loads(path.read_text())
    forged = _entry("forged", priority="urgent").to_json() | {"state": RUNNING, "started_s": time.time(), "nodes": [0]}
    tree["records"] += [
        {"kind": "entry", "name": "forged-full", "value": {"entry": forged, "lease_until": time.time() + 999}},
        {"kind": "preempt", "name": "h-full", "value": {"by": "forged-full"}, "sig": "00" * 32},
    ]
    path.write_text(json.dumps(tree))
    live, _, ignored = local_queue(_cfg(), state)
    assert [e.job_id for e in live] == ["h-full"]
    assert ignored == [
        "pool p: entry forged-full: no signature (not written by the pool authority); ignored",
        "pool p: preempt h-full: bad signature (not written by the pool authority); ignored",
    ]
    assert "1/1 slots in use, 1 running, 0 waiting" in render(_cfg(), live, {}, time.time())
    proc = _start(state, lease_s=20)  # the restarted authority ignores them too, and says so in its log
    time.sleep(2.0)  # the holder reconnects and renews; the forged request does not reach it
    assert holder.stop_reason() is None
    holder.release()
    later = Seat(state, _entry("next"), print)
    assert later.wait(lambda: None) is None  # the forged holder does not keep the slot
    later.release()
    proc.kill()
    proc.wait()
    log = paths(state, "p")["log"]
    said = (proc.stderr.read() if proc.stderr else "") + (log.read_text() if log.exists() else "")
    assert "record entry forged-full: no signature (not written by the pool authority); ignored" in said


def test_the_authority_refuses_a_team_or_class_the_connecting_os_user_is_not_entitled_to(state):
    from traingate.capacity.entitlements import os_user

    me = os_user()
    cfg = _cfg(
        gpus=2,
        entitlements={
            "default": {"classes": ["research"], "quota": {"p": 1}},
            "teams": {
                "vision": {"members": ["someone-else"], "classes": ["research"]},
                "mine": {"members": [me], "classes": ["research", "production"]},
            },
        },
    )
    write_config(state, "p", cfg)
    # Straight to the authority (past the job's own check): the OS user comes from the socket, not the entry.
    cases = [
        (_entry("v", team="vision"), f"OS user {me!r} is not a member of team vision"),
        (_entry("u", team="mine", priority="urgent"), "resources.priority = 'urgent': team mine may use"),
        (_entry("w", team="lab", slots=2), "exceed team lab's quota of 1 (entitlements.default.quota.p)"),
    ]
    for entry, message in cases:
        with pytest.raises(AuthorityError, match=re.escape(message)):
            Seat(state, entry, print).wait(lambda: None)
    ok = Seat(state, _entry("m", team="mine", priority="production", slots=2), print)
    assert ok.wait(lambda: None) is None
    ok.release()


HOLD = """
import sys, time
from pathlib import Path
from traingate.capacity.channel import Seat
from traingate.capacity.queue import Entry
entry = Entry("h1-full", "h1", "full", "a", "research", "p", 1, submit_s=time.time())
seat = Seat(Path(sys.argv[1]), entry, lambda _: None)
assert seat.wait(lambda: None) is None
print("held", flush=True)
time.sleep(600)
"""


def test_killing_the_authority_and_a_holder_mid_lease_books_nothing_twice_and_admits_the_next_job(state):
    write_config(state, "p", _cfg(gpus=2))
    authority = _start(state, lease_s=3)
    h1 = subprocess.Popen([PYTHON, "-c", HOLD, str(state)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert h1.stdout is not None and h1.stdout.readline().strip() == "held"
    # The live holder stops if no renewal gets through for half its lease: 4 s covers starting the new authority
    # (a Python process) on a loaded 2-core box; the dead holder's slot lapses on the authority's 3 s lease.
    h2 = Seat(state, _entry("h2"), print, lease_s=8)
    assert h2.wait(lambda: None) is None
    admitted: dict[str, float] = {}
    w = Seat(state, _entry("w"), print)
    _waiter(w, admitted)
    time.sleep(1.0)
    assert not admitted  # the pool (2 slots) is full
    authority.kill()
    h1.kill()
    killed = time.monotonic()
    authority.wait()
    h1.wait()
    peak, deadline = 0, time.monotonic() + 30
    while "w-full" not in admitted and time.monotonic() < deadline:
        peak = max(peak, len(_held(state)))  # the records the (restarted) authority writes
        assert h2.stop_reason() is None  # the live holder keeps its slot through the restart
        time.sleep(0.05)
    assert "w-full" in admitted, "the next job was not admitted after the dead holder's lease lapsed"
    # Not before the dead holder's lease lapsed: it may still have been training.
    assert admitted["w-full"] - killed >= 2.5
    assert peak <= 2 and sorted(e.job_id for e in _held(state)) == ["h2-full", "w-full"]
    assert h2.stop_reason() is None
    h2.release()
    w.release()


WAIT = """
import sys, time
from pathlib import Path
from traingate.capacity.channel import Seat
from traingate.capacity.queue import Entry
entry = Entry("crash-full", "crash", "full", "a", "research", "p", 1, submit_s=time.time())
Seat(Path(sys.argv[1]), entry, lambda line: print(line, flush=True)).wait(lambda: None)
"""


def test_a_waiter_that_crashes_leaves_the_queue(state):
    write_config(state, "p", _cfg())
    holder = Seat(state, _entry("h"), lambda _: None)
    assert holder.wait(lambda: None) is None
    waiter = subprocess.Popen([PYTHON, "-c", WAIT, str(state)], stdout=subprocess.PIPE, text=True)
    assert waiter.stdout is not None and "waiting for slots" in waiter.stdout.readline()

    def queued() -> list[str]:
        return sorted(records.read_pool(state, "p").of(records.ENTRY))

    assert queued() == ["crash-full", "h-full"]
    waiter.kill()
    waiter.wait()
    deadline = time.monotonic() + 5
    while queued() != ["h-full"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert queued() == ["h-full"]
    holder.release()


def test_a_holder_that_cannot_renew_its_lease_is_told_to_stop_within_half_a_lease(state):
    write_config(state, "p", _cfg())
    authority = _start(state, lease_s=4)
    holder = Seat(state, _entry("h"), lambda _: None, lease_s=4)
    assert holder.wait(lambda: None) is None
    paths(state, "p")["config"].unlink()  # no authority can start again: nothing renews the lease
    authority.kill()
    lost = time.monotonic()
    authority.wait()
    while holder.stop_reason() is None and time.monotonic() - lost < 10:
        time.sleep(0.05)
    why = holder.stop_reason()
    assert why is not None and why.startswith("slots lost: the lease on p could not be renewed for 2 s"), why
    assert time.monotonic() - lost < 4  # before the lease (4 s) could have lapsed
    holder.release()


def test_a_state_directory_deeper_than_a_unix_socket_path_allows_still_admits_a_job(tmp_path):
    # AF_UNIX takes 107 bytes of path; pytest's own temp dirs under xdist reach 110 for a pool's socket.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert len(str(paths(deep, "p")["sock"])) > 107
    write_config(deep, "p", _cfg())
    seat = Seat(deep, _entry("h"), print)
    try:
        assert seat.wait(lambda: None) is None  # the authority is started on demand and reached
        assert [e.job_id for e in _held(deep)] == ["h-full"]
        seat.release()
        assert _held(deep) == []
    finally:
        stop(deep, "p")


def test_a_job_of_another_os_user_is_refused_in_one_line_instead_of_waiting_forever(state):
    """The authority's socket is 0600: a job of another OS user cannot connect, and says so at once rather
    than retrying for ever (a PermissionError is not a missing authority). The socket is handed to user 65534
    and the job runs as root without the capabilities that override file permissions: the kernel's check
    for another user's socket, on a machine where the venv lives under root's private home."""
    write_config(state, "p", _cfg())
    proc = _start(state, lease_s=30)
    os.chown(paths(state, "p")["sock"], 65534, 65534)
    code = (
        "import sys\n"
        "from traingate.capacity.channel import AuthorityError, connect\n"
        "try:\n"
        f"    connect({str(state)!r}, 'p', timeout_s=20)\n"
        "except AuthorityError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    drop = "-dac_override,-dac_read_search"
    t0 = time.monotonic()
    out = subprocess.run(
        ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", PYTHON, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3, out.stdout + out.stderr
    assert time.monotonic() - t0 < 15
    line = out.stdout.strip()
    assert "refuses this OS user" in line and "TRAINGATE_STATE_DIR" in line and "\n" not in line
    proc.terminate()
    proc.wait(10)


def test_the_queue_view_lists_a_job_past_the_starvation_bound_first_and_starts_it_before_a_newer_production_job():
    from flows.cli.queue import render

    now = time.time()
    busy = Entry("x-full", "x", "full", "a", "research", "p", 1, submit_s=now - 3 * 3600, state=RUNNING, beat_s=now,
                 started_s=now - 3 * 3600, nodes=(0,))
    old = Entry("old-full", "old", "full", "a", "research", "p", 1, submit_s=now - 2 * 3600, beat_s=now)
    new = Entry("new-full", "new", "full", "b", "production", "p", 1, submit_s=now - 60, beat_s=now)
    for bound, first, second in ((1, "old-full", "new-full"), (None, "new-full", "old-full")):
        text = render(_cfg(2, scheduling={"starvation_bound_h": bound}), [busy, old, new], {}, now)
        waiting = [line.split() for line in text.splitlines() if line.lstrip().startswith("#")]
        assert [(w[0], w[1]) for w in waiting] == [("#1", first), ("#2", second)], text
        assert "start now" in " ".join(waiting[0]) and "start now" not in " ".join(waiting[1]), text
