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




_WARM_THEN_FORK = """
import os, sys
from mlflow.tracking import MlflowClient
from traingate.tracking import runs
runs.warm_mlflow()  # as an engine preloads it, before any store exists
for db in ("fresh.db", "stale.db"):  # a forked child per database: each opens and checks its own
    pid = os.fork()
    if pid == 0:
        try:
            c = MlflowClient(f"sqlite:///{os.path.join(sys.argv[1], db)}")
            c.create_run(c.create_experiment("e"))
            c.search_registered_models()
        except Exception as e:
            os._exit(2 if "out-of-date database schema" in str(e) else 3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(db, os.waitstatus_to_exitcode(status))
"""


def test_a_warmed_up_mlflow_opens_each_forked_childs_own_store_and_still_checks_its_schema(tmp_path):
    stale = tmp_path / "stale.db"
    runs.client(f"sqlite:///{stale}").create_experiment("x")
    with sqlite3.connect(stale) as conn:  # stamped with a schema revision this MLflow does not have
        conn.execute("UPDATE alembic_version SET version_num = 'abc123'")
    out = subprocess.run([PYTHON, "-c", _WARM_THEN_FORK, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["fresh.db", "0", "stale.db", "2"], out.stderr[-2000:]
