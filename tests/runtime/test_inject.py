"""The drills' ``savestop`` and ``stop`` faults stop the process before the thread that fired them goes one
step further: an async save's writer thread stopped at ``before_manifest`` leaves its manifest unwritten
however busy the training (main) thread is."""
from __future__ import annotations

import subprocess
import textwrap

from tgtest import PYTHON, ROOT

# Forked children of one interpreter (torch imported once): each pinned to one CPU, its main thread spinning
# as a training loop does, a second thread firing the fault and then writing the file the fault is meant to
# keep from being written. The parent waits for each child to stop and counts the files written.
CHILDREN = textwrap.dedent("""
    import os, signal, sys, tempfile, threading, time
    from pathlib import Path
    from traingate.runtime import inject

    root, went_on = Path(tempfile.mkdtemp(dir=sys.argv[1])), 0
    for i in range(int(sys.argv[2])):
        manifest = root / f"manifest{i}"
        pid = os.fork()
        if pid == 0:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            injector = inject.Injector(inject.parse("savestop@15"), 0, root / f"faults{i}")

            def writer():
                injector.storage_hook("before_manifest", 15)
                manifest.write_text("written")

            threading.Thread(target=writer).start()
            end = time.monotonic() + 60
            while time.monotonic() < end:
                pass
            os._exit(0)
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        went_on += manifest.exists()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(went_on)
    """)


def test_a_savestop_fired_by_a_save_thread_stops_the_process_before_that_thread_writes_its_manifest(tmp_path):
    out = subprocess.run(
        [PYTHON, "-c", CHILDREN, str(tmp_path), "8"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0"], out.stdout  # no child's writer went past its fault
