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
