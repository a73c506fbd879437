"""The thin entry's side of the hand-off (traingate/runtime/handoff.py) against a zygote that goes away
before a child exists: whether it read the request or not, the entry starts the process itself."""
from __future__ import annotations

import os
import select
import socket
import threading
from pathlib import Path

import pytest

from traingate.runtime import handoff


@pytest.mark.parametrize("read_first", [True, False], ids=["request-read", "request-unread"])
def test_a_zygote_that_dies_before_forking_makes_the_entry_start_cold(tmp_path: Path, read_first: bool):
    path = str(tmp_path / "zygote.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def zygote() -> None:
        conn, _ = server.accept()
        select.select([conn], [], [], 10)  # the request has arrived
        if read_first:
            _, fds = handoff.read_request(conn)
            for fd in fds:
                os.close(fd)
        # Closed with the request unread, the entry's next read is a reset, not an end of input.
        conn.close()

    t = threading.Thread(target=zygote, daemon=True)
    t.start()
    ran_cold: list[bool] = []
    status = handoff.ask(path, {"argv": ["train"]}, lambda: ran_cold.append(True) or 7)
    t.join(10)
    server.close()
    assert (status, ran_cold) == (7, [True])


ZYGOTE = """
import os, socket, sys, weakref
from traingate.runtime import handoff

class Held:
    pass

out = sys.argv[2]
held = Held()
weakref.finalize(held, lambda: open(os.path.join(out, "zygote"), "w").close())  # the zygote's own clean-up
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(1)
print("ready", flush=True)
conn, _ = server.accept()
request, fds = handoff.read_request(conn)
if os.fork() == 0:
    done = handoff.take_place(conn, request, fds, "test-entry-watch")
    mine = Held()
    weakref.finalize(mine, lambda: open(os.path.join(out, "child"), "w").close())
    handoff.run_and_finish(conn, done, lambda: 3)
os._exit(0)
"""


def test_a_forked_child_runs_its_own_finalizers_at_exit_and_not_the_zygotes(tmp_path: Path):
    import subprocess
    import sys

    path = str(tmp_path / "zygote.sock")
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE, path, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert zygote.stdout is not None and zygote.stdout.readline() == "ready\n"
        status = handoff.ask(path, {"argv": ["x"], "cwd": str(tmp_path), "env": dict(os.environ)}, lambda: 99)
        assert zygote.wait(10) == 0
    finally:
        zygote.kill()
    assert status == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name in ("child", "zygote")) == ["child"]


def test_a_forked_child_lets_go_of_the_entrys_output_before_its_exit_status_goes_out():
    # Whoever reads the entry's output to its end sees the end as the entry exits, not once the kernel has taken the
    # child's memory apart: here the child lingers after telling its status, as a large one does in its exit.
    out_r, out_w = os.pipe()
    here, child_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: its stdout and stderr are the entry's output
        try:
            here.close()
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            os.close(out_w)
            os.close(out_r)
            real_exit = os._exit

            def lingering_exit(code: int) -> None:
                select.select([], [], [], 3.0)
                real_exit(code)

            handoff.os._exit = lingering_exit  # type: ignore[assignment]  # this process only: a forked copy
            handoff.finish(child_end, threading.Event(), 4)
        finally:
            os._exit(70)
    os.close(out_w)
    child_end.close()
    try:
        record = here.recv(handoff.REC.size)
        assert handoff.REC.unpack(record) == (b"X", 4)
        ready, _, _ = select.select([out_r], [], [], 2.0)
        assert ready and os.read(out_r, 100) == b""  # the output's end, while the child still lingers
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
    finally:
        os.waitpid(pid, 0)
        os.close(out_r)
        here.close()
