"""The guardian stops what a dead orchestrator started: its children and their children, in sessions of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from tgtest import PYTHON

from traingate.supervision import guardian

# An orchestrator stand-in: starts a child in a session of its own (as the CLI starts torchrun), which starts a
# grandchild (a torchrun worker), prints both pids and waits.
ORCHESTRATOR = """
import subprocess, sys, time
inner = "import subprocess, sys, time; g = subprocess.Popen(['sleep', '300']); print(g.pid, flush=True); time.sleep(300)"
child = subprocess.Popen([sys.executable, "-c", inner], stdout=subprocess.PIPE, text=True, start_new_session=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def test_a_sigkilled_orchestrators_child_and_grandchild_are_stopped_by_its_guardian_and_nothing_else_is():
    bystander = subprocess.Popen(["sleep", "300"])  # not the orchestrator's: must survive
    orchestrator = subprocess.Popen([PYTHON, "-c", ORCHESTRATOR], stdout=subprocess.PIPE, text=True)
    watcher = None
    try:
        child, grandchild = map(int, orchestrator.stdout.readline().split())
        assert guardian.descendant_pids(orchestrator.pid) == {child, grandchild}
        watcher = guardian.start(grace_s=2.0, pid=orchestrator.pid)
        time.sleep(3 * guardian.POLL_S)  # one look at the tree at least
        orchestrator.kill()
        orchestrator.wait()
        assert watcher.wait(timeout=30) == 0
        for pid in (child, grandchild):
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
        assert bystander.poll() is None
    finally:
        for proc in (orchestrator, bystander, watcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_descendants_are_read_from_the_kernels_child_lists_of_every_thread():
    # A child started by another thread of this process is this process's child too.
    import threading

    started: list[subprocess.Popen] = []
    t = threading.Thread(target=lambda: started.append(subprocess.Popen(["sleep", "30"])))
    t.start()
    t.join()
    try:
        assert started[0].pid in guardian.descendant_pids(os.getpid())
    finally:
        started[0].send_signal(signal.SIGKILL)
        started[0].wait()
    assert sys.platform != "linux" or guardian._PROC_CHILDREN
