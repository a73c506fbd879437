"""Time lost to a restart counts the work after the step resumed from, and a crash's downtime; the wait of a
stage paused (or preempted) at its emergency checkpoint until someone resumes it is not lost. Real MLflow
(SQLite) through rank 0's tracker and its journal."""

from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient
from tracking_helpers import fresh_store, new_run

from traingate.tracking.tracker import make_tracker

WAIT_S = 2.0


@pytest.mark.parametrize("first_end, lost_at_least, lost_below", [("preempted", 0.0, WAIT_S), (None, WAIT_S, 60.0)])
def test_the_wait_of_a_paused_stage_is_not_time_lost_and_a_crashs_downtime_is(
    tmp_path, first_end, lost_at_least, lost_below
):
    uri = fresh_store(tmp_path / "mlflow.db")
    run_id = new_run(uri)
    first = make_tracker(0, True, uri, run_id, journal_dir=tmp_path / "stage")
    first.start_session(0)
    for step in range(1, 11):
        first.log_metrics({"train_loss": 1.0 / step}, step=step)
    if first_end is not None:  # paused at its emergency checkpoint of step 10; a crash writes no end
        first.end_session(first_end)
    first.close()
    time.sleep(WAIT_S)  # paused until `traingate resume`; or down after the crash

    second = make_tracker(0, True, uri, run_id, journal_dir=tmp_path / "stage")
    second.start_session(10, "preempted" if first_end else "worker_lost")
    second.close()

    lost = float(MlflowClient(uri).get_run(run_id).data.tags["traingate.restart.1.time_lost_s"])
    assert lost_at_least <= lost < lost_below, lost
