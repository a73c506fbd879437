"""The one authority of a local pool: the single process that admits, caps and preempts its jobs.

``python -m traingate.capacity.authority --pool P --state-dir D`` (the first job that needs it starts it:
:mod:`traingate.capacity.channel`). An exclusive lock on ``authority/<pool>.lock`` makes it the only one;
a second start exits at once, and a restarted one carries on from its signed records. It listens on a Unix
socket (``authority/<pool>.sock``); each job keeps one connection open:

- a waiter sends ``wait`` with its :class:`~traingate.capacity.queue.Entry` and blocks; the authority checks
  the OS user of the connection (its peer credentials, not anything the job says) against the pools file's
  entitlements, queues the job, and pushes ``admitted`` (nodes, how) when the policy starts it. It runs the
  policy (:func:`traingate.capacity.policy.schedule`) on every change - a job queued, released or gone, a
  lease lapsed - so a release admits the next job in policy order at once. A waiter whose connection closes
  (it crashed) leaves the queue.
- a holder sends ``renew`` every second; the reply carries a preemption request when the policy wants its
  slots. A holder whose renewals stop loses its slots when its lease lapses (``--lease-s``), not before: its
  training may still be running. After an authority restart the holders reconnect with ``hold``.
- ``release`` gives the slots back (``requeue``: wait again to resume); the team's fair-share usage and the
  run-length history are folded in.

Every change is written to ``authority/<pool>.records.json``, each record signed with the pool's key
(:mod:`traingate.capacity.records`); nothing of the queue lives on the Prefect server, so no API client can
write a queue, quota or preemption record. With no job and no connection for ``--idle-exit-s`` it exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traingate.capacity import entitlements, records
from traingate.capacity.gang import footprint
from traingate.capacity.policy import How, Start, never_fits, schedule
from traingate.capacity.pools import CapacityConfig, CapacityError, parse_config
from traingate.capacity.queue import (
    RUNNING,
    WAITING,
    Entry,
    _predict,
    decide,
    describe_wait,
    fold_usage,
    placed,
    rules_for,
    usage_now,
)

LEASE_S = 20.0  # a holder that stops renewing keeps its slots this long (its training may still be running)
RECONNECT_S = 5.0  # after a restart: how long a recorded holder has to reconnect before its lease may lapse
IDLE_EXIT_S = 60.0
HISTORY_N = 20
PERSIST_RENEWALS_S = 1.0  # lease renewals alone are written at most this often


UNIX_PATH_MAX = 107  # bytes of a socket path AF_UNIX takes (sun_path less its terminating NUL)


def paths(state_dir: str | Path, pool: str) -> dict[str, Path]:
    d = records.authority_dir(state_dir)
    return {
        "sock": d / f"{pool}.sock",
        "lock": d / f"{pool}.lock",
        "config": d / f"{pool}.config.json",
        "log": d / f"{pool}.log",
        "records": records.records_path(state_dir, pool),
    }


def unix_address(path: Path, fd: int | None) -> str:
    """``path`` as an AF_UNIX address. The kernel takes at most 107 bytes; a socket under a deeper state
    directory is reached through ``fd``, an O_PATH descriptor of its folder (``/proc/self/fd/N/name``)."""
    if fd is None:
        return str(path)
    return f"/proc/self/fd/{fd}/{path.name}"


def folder_fd(path: Path) -> int | None:
    """An O_PATH descriptor of ``path``'s folder when ``path`` is too long for AF_UNIX, else None."""
    if len(os.fsencode(str(path))) <= UNIX_PATH_MAX:
        return None
    return os.open(path.parent, os.O_PATH | os.O_DIRECTORY)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel saw it connect."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


@dataclass
class Conn:
    sock: socket.socket
    user: str
    buf: bytes = b""
    job: str | None = None


@dataclass
class State:
    """What the authority knows of its pool; written whole, signed, on every change."""

    entries: dict[str, Entry] = field(default_factory=dict)
    lease_until: dict[str, float] = field(default_factory=dict)  # running job -> wall-clock lapse
    preempt: dict[str, str] = field(default_factory=dict)  # victim -> the job it stops for
    usage: dict[str, tuple[float, float]] = field(default_factory=dict)
    history: dict[str, tuple[float, int]] = field(default_factory=dict)


class Authority:
    def __init__(self, pool: str, state_dir: Path, lease_s: float = LEASE_S, idle_exit_s: float = IDLE_EXIT_S):
        self.pool, self.state_dir, self.lease_s, self.idle_exit_s = pool, state_dir, lease_s, idle_exit_s
        self.p = paths(state_dir, pool)
        self.signer = records.Signer(records.create_key(state_dir, pool))
        self._cfg_mtime = 0.0
        self.cfg = self._config()
        self.state = State()
        self.conns: dict[str, Conn] = {}  # job id -> its connection
        self.sel = selectors.DefaultSelector()
        self._dirty = False
        self._written = 0.0
        self._load(time.time())

    # ------------------------------------------------------------------ records
    def _config(self) -> CapacityConfig:
        if not self.p["config"].is_file():
            raise CapacityError(
                f"no capacity config at {self.p['config']}; a job writes it before it starts the authority"
            )
        st = self.p["config"].stat()
        if st.st_mtime != self._cfg_mtime:
            self._cfg_mtime = st.st_mtime
            cfg = parse_config(json.loads(self.p["config"].read_text()), source=str(self.p["config"]))
            if self.pool not in cfg.pools:
                raise CapacityError(f"{self.p['config']}: no pool {self.pool!r}; use one of {sorted(cfg.pools)}")
            self.cfg = cfg
        return self.cfg

    def _load(self, now: float) -> None:
        got = records.read(self.p["records"], self.signer)
        for line in got.ignored:
            self.say(f"record {line}")
        for name, v in got.of(records.ENTRY).items():
            e = Entry.from_json(v["entry"])
            if e.state == RUNNING:  # waiters reconnect and queue again; holders keep their slots until lapse
                self.state.entries[name] = e
                self.state.lease_until[name] = max(float(v.get("lease_until") or 0.0), now + RECONNECT_S)
        self.state.usage = {t: (float(u), float(a)) for t, (u, a) in got.of(records.USAGE).items()}
        self.state.history = {k: (float(m), int(n)) for k, (m, n) in got.of(records.HISTORY).items()}
        self.state.preempt = {k: str(v["by"]) for k, v in got.of(records.PREEMPT).items() if k in self.state.entries}
        self._write(now)

    def _write(self, now: float) -> None:
        s, sign = self.state, self.signer.sign
        out = [
            sign(records.ENTRY, k, {"entry": e.to_json(), "lease_until": s.lease_until.get(k)})
            for k, e in s.entries.items()
        ]
        out += [sign(records.PREEMPT, k, {"by": by}) for k, by in s.preempt.items()]
        out += [sign(records.USAGE, t, list(v)) for t, v in s.usage.items()]
        out += [sign(records.HISTORY, k, list(v)) for k, v in s.history.items()]
        records.write(self.p["records"], out)
        self._dirty, self._written = False, now

    def say(self, line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} authority {self.pool}: {line}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the policy, carried out
    def _pass(self, now: float) -> None:
        """Lapse what lapsed, then admit whatever the policy starts now (and ask its victims to stop)."""
        s = self.state
        for k in [k for k, t in s.lease_until.items() if t < now]:
            self.say(f"lease of {k} lapsed ({self.lease_s:.0f} s without renewal): its slots are free")
            self._finish(k, now, fold=True)
            c = self.conns.pop(k, None)
            if c is not None:
                self._send(c, {"lost": f"the lease of {k} lapsed: it was not renewed for {self.lease_s:.0f} s"})
                c.job = None
        for v in [v for v, by in s.preempt.items() if by not in s.entries or s.entries[by].state != WAITING]:
            del s.preempt[v]  # the job it was stopping for left or started: nothing to stop for
            self._dirty = True
        cfg = self._config()
        pool = cfg.pools[self.pool]
        entries = list(s.entries.values())
        running_e = [e for e in entries if e.state == RUNNING]
        waiting = [e.job() for e in entries if e.state == WAITING]
        if not waiting:
            return
        running = placed(running_e, pool.gpus_per_node, pool.nodes)
        usage = usage_now(s.usage, running_e, now, cfg.scheduling.half_life_h * 3600.0)
        rules = rules_for(cfg, self.pool, [e.team for e in entries])
        plan = schedule(now, pool, running, waiting, rules, usage, _predict)
        pushes: list[tuple[Start, dict[str, Any]]] = []
        for st in plan.starts:
            if st.how is How.PREEMPTION and any(s.entries[v].state == RUNNING for v in plan.preempted):
                # Its victims stop at a checkpoint and release first; the pass after their release starts it.
                for v in plan.preempted:
                    if v not in s.preempt:
                        s.preempt[v] = st.job_id
                        self.say(f"asked {v} to stop for {st.job_id}")
                        self._dirty = True
                break
            e = s.entries[st.job_id]
            s.entries[st.job_id] = dataclasses.replace(e, state=RUNNING, started_s=now, nodes=st.nodes, beat_s=now)
            s.lease_until[st.job_id] = now + self.lease_s
            s.preempt.pop(st.job_id, None)
            self._dirty = True
            victims = [v for v, by in s.preempt.items() if by == st.job_id]
            pushes.append((st, {"nodes": list(st.nodes), "how": st.how.value, "victims": victims}))
        if not pushes:
            return
        # Recorded before any job hears of it: a restarted authority knows every slot a job believes it holds.
        self._write(now)
        gone = False
        for st, admitted in pushes:
            c = self.conns.get(st.job_id)
            if c is None or not self._send(c, {"admitted": {**admitted, "lease_s": self.lease_s}}):
                self._finish(st.job_id, now, fold=False)  # gone between its wait and its start
                gone = True
                continue
            self.say(f"admitted {st.job_id} ({st.how.value}) on nodes {list(st.nodes)}")
        if gone:
            self._pass(now)

    def _finish(self, job: str, now: float, fold: bool) -> None:
        """Remove a job from the pool (its slots come back); ``fold``: charge its held time to fair share."""
        s = self.state
        e = s.entries.pop(job, None)
        s.lease_until.pop(job, None)
        s.preempt.pop(job, None)
        if e is not None and fold and e.state == RUNNING and e.started_s is not None:
            self._fold(e, now)
        self._dirty = True

    def _fold(self, e: Entry, now: float) -> None:
        pool = self.cfg.pools[self.pool]
        from_ = e.started_s if e.started_s is not None else now
        need = footprint(e.slots, pool.gpus_per_node)
        self.state.usage[e.team] = fold_usage(
            self.state.usage.get(e.team), need, from_, now, self.cfg.scheduling.half_life_h * 3600.0
        )

    # ------------------------------------------------------------------ requests
    def handle(self, c: Conn, msg: dict[str, Any], now: float) -> None:
        op = msg.get("op")
        s = self.state
        if op == "wait":
            e = Entry.from_json(msg["entry"])
            why = self._refusal(c, e)
            if why is not None:
                self._send(c, {"refused": why})
                return
            old = s.entries.get(e.job_id)
            if old is not None and old.state == RUNNING:
                self._send(c, {"refused": f"{e.job_id} already holds slots on {self.pool}"})
                return
            # Waiting again after a preemption (or a reconnection): its place and attempt count are the queue's.
            submit, attempt = (old.submit_s, old.attempt) if old is not None else (e.submit_s, e.attempt)
            s.entries[e.job_id] = dataclasses.replace(
                e, state=WAITING, user=c.user, submit_s=submit, attempt=attempt, beat_s=now
            )
            c.job = e.job_id
            self.conns[e.job_id] = c
            self._write(now)  # recorded before the job hears it is queued
            self._send(c, {"queued": self._where(e.job_id, now)})
        elif op == "hold":  # a holder's reconnection after an authority restart
            job = str(msg["job_id"])
            held = s.entries.get(job)
            if held is None or held.state != RUNNING or held.user != c.user:
                self._send(c, {"lost": f"{job} holds no slots on {self.pool} (its lease lapsed)"})
                return
            c.job = job
            self.conns[job] = c
            s.lease_until[job] = now + self.lease_s
            self._send(c, {"renewed": True, "preempt": s.preempt.get(job)})
        elif op == "renew":
            mine = c.job
            if mine is None or mine not in s.entries or s.entries[mine].state != RUNNING:
                self._send(c, {"lost": f"{mine} holds no slots on {self.pool} (its lease lapsed)"})
                return
            s.lease_until[mine] = now + self.lease_s
            s.entries[mine] = dataclasses.replace(s.entries[mine], progress=str(msg.get("progress") or ""), beat_s=now)
            if now - self._written >= PERSIST_RENEWALS_S:
                self._dirty = True
            self._send(c, {"renewed": True, "preempt": s.preempt.get(mine)})
        elif op == "where":
            self._send(c, {"status": self._where(c.job, now) if c.job in s.entries else ""})
        elif op == "release":
            self._release(c, bool(msg.get("requeue")), msg.get("kind"), msg.get("held_s"), now)
            self._write(now)  # recorded before the job hears its slots are back
            self._send(c, {"released": True})
        else:
            self._send(c, {"refused": f"unknown request {op!r}"})

    def _refusal(self, c: Conn, e: Entry) -> str | None:
        if e.pool != self.pool:
            return f"{e.job_id}: pool {e.pool!r} is not this authority's pool {self.pool!r}"
        cfg = self.cfg
        why = entitlements.problem(cfg, c.user, e.team, e.priority, e.pool, e.slots)
        if why is None:
            quotas = {e.team: {e.pool: q}} if (q := cfg.quota_of(e.team, e.pool)) is not None else {}
            why = never_fits(e.job(), cfg.pools, cfg.priority_classes, quotas)
        return None if why is None else f"{e.run_id} {e.stage}: {why}"

    def _release(self, c: Conn, requeue: bool, kind: Any, held_s: Any, now: float) -> None:
        s = self.state
        job = c.job
        e = s.entries.get(job) if job is not None else None
        if e is None:
            return
        if e.state == RUNNING:
            self._fold(e, now)
        if requeue:
            s.entries[e.job_id] = dataclasses.replace(
                e, state=WAITING, started_s=None, nodes=(), attempt=e.attempt + 1, beat_s=now
            )
            s.lease_until.pop(e.job_id, None)
            s.preempt.pop(e.job_id, None)
        else:
            if isinstance(kind, str) and isinstance(held_s, int | float) and held_s > 0 and e.job_id not in s.preempt:
                mean, n = s.history.get(kind, (0.0, 0))
                n = min(n, HISTORY_N - 1)  # a running mean over about the last HISTORY_N runs
                s.history[kind] = ((mean * n + float(held_s)) / (n + 1), n + 1)
            self._finish(e.job_id, now, fold=False)
            self.conns.pop(e.job_id, None)
            c.job = None
        self._dirty = True

    def _where(self, job: str | None, now: float) -> str:
        if job is None or job not in self.state.entries:
            return ""
        e = self.state.entries[job]
        if e.state == RUNNING:
            return f"running on {self.pool}"
        entries = list(self.state.entries.values())
        usage = usage_now(
            self.state.usage,
            [x for x in entries if x.state == RUNNING],
            now,
            self.cfg.scheduling.half_life_h * 3600.0,
        )
        d = decide(job, entries, self.cfg, now, usage)
        return describe_wait(d, now - e.submit_s, now)

    def _closed(self, c: Conn, now: float) -> None:
        self.sel.unregister(c.sock)
        c.sock.close()
        job = c.job
        if job is None or self.conns.get(job) is not c:
            return
        del self.conns[job]
        e = self.state.entries.get(job)
        if e is not None and e.state == WAITING:  # a waiter that crashed (or was cancelled) leaves the queue
            self._finish(job, now, fold=False)
            self.say(f"{job} left the queue (its connection closed)")
        # A holder's slots stay held until its lease lapses: its training may still be running.

    def _send(self, c: Conn, msg: dict[str, Any]) -> bool:
        try:
            c.sock.sendall(json.dumps(msg).encode() + b"\n")
            return True
        except OSError:
            return False

    # ------------------------------------------------------------------ the loop
    def serve(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, None)
        idle_since = time.monotonic()
        self.say(f"serving on {self.p['sock']} (lease {self.lease_s:.0f} s)")
        self._pass(time.time())
        while True:
            events = self.sel.select(timeout=0.25)
            now = time.time()
            changed = False
            for k, _ in events:
                if k.data is None:
                    try:
                        sock, _addr = listener.accept()
                    except BlockingIOError:
                        continue
                    sock.setblocking(True)
                    sock.settimeout(5.0)
                    c = Conn(sock, entitlements.os_user(peer_uid(sock)))
                    self.sel.register(sock, selectors.EVENT_READ, c)
                    continue
                c = k.data
                try:
                    data = c.sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    self._closed(c, now)
                    changed = True
                    continue
                c.buf += data
                while b"\n" in c.buf:
                    line, c.buf = c.buf.split(b"\n", 1)
                    try:
                        msg = json.loads(line)
                    except json.JSONDecodeError:
                        self._send(c, {"refused": "not a JSON line"})
                        continue
                    self.handle(c, msg, now)
                    changed = changed or msg.get("op") in ("wait", "release")
            if changed or self.state.lease_until:
                self._pass(now)
            if self._dirty:
                self._write(now)
            if self.state.entries or len(self.sel.get_map()) > 1:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > self.idle_exit_s:
                self.say(f"idle for {self.idle_exit_s:.0f} s: exiting")
                return


def running_pid(state_dir: str | Path, pool: str) -> int | None:
    """The pid of the authority serving ``pool`` from ``state_dir``, or None (its lock file names the last
    one; a pid that is no longer that authority's process is not it)."""
    lock = paths(state_dir, pool)["lock"]
    text = lock.read_text().strip() if lock.is_file() else ""
    if not text.isdigit():
        return None
    try:
        argv = Path(f"/proc/{text}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    want = [b"traingate.capacity.authority", pool.encode(), str(state_dir).encode()]
    return int(text) if all(w in argv for w in want) else None


def stop(state_dir: str | Path, pool: str) -> bool:
    """SIGTERM the pool's authority if one runs (tests, benchmarks); True when one was stopped."""
    pid = running_pid(state_dir, pool)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def run(pool: str, state_dir: Path, lease_s: float, idle_exit_s: float) -> int:
    p = paths(state_dir, pool)
    lock = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return 0  # another authority holds the pool: it is the one
        raise
    os.ftruncate(lock, 0)
    os.write(lock, f"{os.getpid()}\n".encode())  # who holds the pool (`traingate queue`, tests stop it by it)
    # Holding the lock: a socket file left by a killed authority is stale.
    p["sock"].unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    fd = folder_fd(p["sock"])
    try:
        listener.bind(unix_address(p["sock"], fd))
    finally:
        os.umask(old)
        if fd is not None:
            os.close(fd)
    listener.listen(1024)
    try:
        Authority(pool, state_dir, lease_s, idle_exit_s).serve(listener)
    except CapacityError as e:
        print(f"authority {pool}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        p["sock"].unlink(missing_ok=True)
        listener.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m traingate.capacity.authority", description=__doc__.split("\n")[0])
    ap.add_argument("--pool", required=True)
    ap.add_argument("--state-dir", required=True, type=Path)
    ap.add_argument("--lease-s", type=float, default=LEASE_S)
    ap.add_argument("--idle-exit-s", type=float, default=IDLE_EXIT_S)
    a = ap.parse_args(argv)
    return run(a.pool, a.state_dir, a.lease_s, a.idle_exit_s)


if __name__ == "__main__":
    sys.exit(main())
