"""Which run a process orchestrates: its own claims (traingate.tracking.stale.claim), not a scan of the state
directory's runs, and none that another process has taken over since."""

from __future__ import annotations

import os
from pathlib import Path

from traingate.job.files import write_json
from traingate.tracking import stale


def test_the_run_claimed_last_is_this_processs_until_another_process_takes_it_over(tmp_path: Path):
    runs = tmp_path / "runs"
    first, second = runs / "a1", runs / "b2"
    stale.claim(first, "flow-run-1")
    stale.claim(second, "flow-run-2")
    assert stale.claimed_here() == second
    (runs / "c3").mkdir()
    write_json(runs / "c3" / stale.ORCHESTRATOR, {"pid": os.getpid(), "started": 0.0})  # not claimed by this process
    assert stale.claimed_here() == second
    write_json(second / stale.ORCHESTRATOR, {"pid": os.getpid() + 1, "started": 0.0})  # a resume elsewhere took it
    assert stale.claimed_here() == first
    stale.claim(second, "flow-run-3")  # taken back
    assert stale.claimed_here() == second
