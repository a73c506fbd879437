"""A zygote started ahead of its supervisor (``python -m traingate.runtime.warm --ahead LOG COMMAND...``, how a
Slurm batch step of a warm stage starts): the command it execs into holds it as its child and takes it over."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import json, os, sys
    import psutil
    from traingate.runtime.warm import Zygote
    handle = sys.argv[sys.argv.index("--zygote") + 1]
    zygote = Zygote.adopt(handle, sys.argv[1])
    child = psutil.Process(zygote.pid)
    env = child.environ()
    seen = {"self": os.getpid(), "parent": child.ppid(), "alive": zygote.popen.poll() is None,
            "omp": env.get("OMP_NUM_THREADS"), "unbuffered": env.get("PYTHONUNBUFFERED")}
    seen.update(stopped=zygote.stop(grace_s=0.2), code=zygote.popen.poll(), dir_left=os.path.exists(zygote.dir))
    print(json.dumps(seen))
""")


def test_a_zygote_started_ahead_is_the_child_of_the_command_it_execs_into_which_adopts_and_stops_it(tmp_path):
    probe, log = tmp_path / "probe.py", tmp_path / "zygote.log"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED")}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "traingate.runtime.warm", "--ahead", str(log), sys.executable, str(probe), str(log)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    seen = json.loads(out)
    # exec keeps the pid: the command is the process that started the zygote, so the zygote ends with it
    assert seen["self"] == launcher.pid == seen["parent"]
    assert seen["alive"] and seen["stopped"] is None and seen["code"] is not None and not seen["dir_left"]
    # forking needs a single-threaded zygote; its workers' output is not held in a buffer
    assert (seen["omp"], seen["unbuffered"]) == ("1", "1")
