"""traingate's SQLite tracking store (the default, state/mlflow.db) on a real MLflow client."""
from __future__ import annotations

import sqlite3
import subprocess

from tgtest import PYTHON, ROOT

from traingate.tracking import runs

_STAGE_PROCESS = """
import sys
from mlflow.tracking import MlflowClient
c = MlflowClient(sys.argv[1])
c.log_metric(sys.argv[2], "loss", 0.5, step=1)
"""


def _mode(db) -> str:
    with sqlite3.connect(db) as conn:
        return conn.execute("PRAGMA journal_mode").fetchone()[0]


def test_the_store_is_kept_in_write_ahead_log_mode_for_every_process_that_opens_it(tmp_path):
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    c = runs.client(uri)
    run = c.create_run(c.create_experiment("e"))
    assert _mode(db) == "wal"
    # another process (a stage's, a script's) writes through its own client into the same store
    p = subprocess.run([PYTHON, "-c", _STAGE_PROCESS, uri, run.info.run_id], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert [m.value for m in c.get_metric_history(run.info.run_id, "loss")] == [0.5]
    assert _mode(db) == "wal"

