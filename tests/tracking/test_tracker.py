"""The rank-0 writer: journaled, replayed after a kill, never logs a step twice; other ranks write nothing."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from tgtest import free_port
from tracking_helpers import fresh_store, new_run, steps_of
from traingate.tracking.journal import Journal
from traingate.tracking.tracker import MlflowTracker, NullTracker, make_tracker


def _fail_fast(monkeypatch) -> None:
    # What the tracker sets for itself in a training process; set here so the test process gets it back.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def test_records_a_process_could_not_deliver_are_replayed_by_the_next_process_of_the_stage(tmp_path, monkeypatch):
    _fail_fast(monkeypatch)
    uri = fresh_store(tmp_path / "mlflow.db")
    run_id = new_run(uri)
    journal_dir = tmp_path / "stage" / "tracking"
    # First process: its store is unreachable (nothing listens on that port) for its whole life.
    first = MlflowTracker(f"http://127.0.0.1:{free_port()}", run_id, journal_dir, drain_timeout_s=0)
    first.start_session(0)
    for step in range(1, 51):
        first.log_metrics({"train_loss": 1.0 / step, "lr": 0.1}, step)
    first.close()  # what a killed process leaves behind: everything still in the journal
    assert Journal(journal_dir / "journal.jsonl").pending_bytes() > 0
    client = MlflowClient(uri)
    assert steps_of(client, run_id, "train_loss") == []

    # Second process: resumed from the checkpoint at step 40, so it redoes steps 41..50.
    second = MlflowTracker(uri, run_id, journal_dir)
    second.start_session(40)
    for step in range(41, 81):
        second.log_metrics({"train_loss": 1.0 / step, "lr": 0.1}, step)
    second.end_session("completed")
    second.close()
    assert second.dropped_duplicates == 20  # steps 41..50 of two metrics were logged by the first process
    assert steps_of(client, run_id, "train_loss") == list(range(1, 81))
    assert steps_of(client, run_id, "lr") == list(range(1, 81))
    tags = client.get_run(run_id).data.tags
    assert tags["traingate.restarts"] == "1" and tags["traingate.restart.1.resumed_from_step"] == "40"
    assert Journal(journal_dir / "journal.jsonl").pending_bytes() == 0


def test_tags_and_text_artifacts_go_through_the_journal_with_secrets_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "tracker-test-secret-123456")
    uri = fresh_store(tmp_path / "mlflow.db")
    run_id = new_run(uri)
    t = MlflowTracker(uri, run_id, tmp_path / "tracking")
    t.set_tags({"traingate.data_uri": "s3://user:hunter2-pw@bucket/data", "note": "key tracker-test-secret-123456"})
    t.log_text("connect with postgresql://tg:hunter2-pw@db/x", "notes/conn.txt")
    t.close()
    client = MlflowClient(uri)
    tags = client.get_run(run_id).data.tags
    assert tags["traingate.data_uri"] == "s3://user:***@bucket/data" and tags["note"] == "key ***"
    text = (tmp_path / "dl").mkdir() or client.download_artifacts(run_id, "notes/conn.txt", str(tmp_path / "dl"))
    assert open(text).read() == "connect with postgresql://tg:***@db/x"


def test_only_rank_zero_with_a_run_to_write_into_gets_a_writer(tmp_path):
    uri = fresh_store(tmp_path / "mlflow.db")
    assert type(make_tracker(1, True, uri, "abc", tmp_path)) is NullTracker
    assert type(make_tracker(0, False, uri, "abc", tmp_path)) is NullTracker
    assert type(make_tracker(0, True, uri, None, tmp_path)) is NullTracker
    t = make_tracker(0, True, uri, new_run(uri), tmp_path)
    assert isinstance(t, MlflowTracker)
    t.close()


def test_a_process_relaunched_without_a_run_id_continues_the_run_its_checkpoint_was_written_under(tmp_path):
    import torch

    from traingate.runtime.checkpoint import Checkpointer
    from traingate.tracking.tracker import run_to_resume

    ckpt = Checkpointer((tmp_path / "ckpt").as_uri(), async_save=False)
    assert run_to_resume(None, ckpt) is None  # nothing saved yet: nothing to continue
    ckpt.save(5, {"model": {"w": torch.zeros(2)}}, {"mlflow_run_id": "0123abcd"})
    assert run_to_resume(None, ckpt) == "0123abcd"
    assert run_to_resume("handed-over", ckpt) == "handed-over"  # MLFLOW_RUN_ID wins
    assert run_to_resume(None, None) is None  # ranks without a checkpointer
    ckpt.close()


def test_a_process_that_continues_after_the_planned_stop_is_logged_at_info_and_a_real_restart_at_warning(
    tmp_path, caplog
):
    uri = fresh_store(tmp_path / "mlflow.db")
    run_id = new_run(uri)
    journal_dir = tmp_path / "tracking"
    first = MlflowTracker(uri, run_id, journal_dir)
    first.start_session(0)
    first.log_metrics({"train_loss": 1.0}, 3)
    first.end_session("stopped")  # the smoke stage's half-way stop at a checkpoint
    first.close()
    caplog.set_level("INFO", logger="traingate.tracking.tracker")
    second = MlflowTracker(uri, run_id, journal_dir)
    second.start_session(3)
    second.close()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "traingate.tracking.tracker"]
    assert said == [
        ("INFO", "process 2 of this run continues from step 3 after the planned stop at that checkpoint (stopped)")
    ]
    caplog.clear()
    third = MlflowTracker(uri, run_id, journal_dir)
    third.start_session(3, restart_cause="worker_lost")
    third.close()
    levels = [r.levelname for r in caplog.records if r.name == "traingate.tracking.tracker"]
    assert levels == ["WARNING"] and "restart 2 of this run (cause worker_lost)" in caplog.records[-1].getMessage()
