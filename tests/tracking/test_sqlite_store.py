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


_KEEP_THEN_FORK = """
import os, sys
from traingate.tracking import compat_mlflow, runs
d = sys.argv[1]
uri = f"sqlite:///{d}/mlflow.db"
runs.keep_store_open(uri)  # as the CLI engine keeps its state directory's store
parent = runs.client(uri)
parent.create_experiment("after-keep")  # written by the parent after it kept the store: a child reads it
def child(label):
    pid = os.fork()
    if pid == 0:
        try:
            c = runs.client(uri)
            names = sorted(e.name for e in c.search_experiments())
            c.create_run(c.get_experiment_by_name(names[0]).experiment_id)  # a write on the child's own connection
            print(label, ",".join(names), flush=True)
        except Exception as e:
            print(label, "error:", type(e).__name__, str(e)[:200], flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
child("kept")
for engine in compat_mlflow.sql_engines(parent):
    engine.dispose()
for suffix in ("", "-wal", "-shm"):  # the kept database moved away: the path is a new database's
    if os.path.exists(f"{d}/mlflow.db{suffix}"):
        os.replace(f"{d}/mlflow.db{suffix}", f"{d}/old.db{suffix}")
child("replaced")
"""


def test_a_store_kept_open_for_forked_children_serves_them_and_a_replaced_database_is_opened_anew(tmp_path):
    runs.client(f"sqlite:///{tmp_path / 'mlflow.db'}").create_experiment("before")
    out = subprocess.run([PYTHON, "-c", _KEEP_THEN_FORK, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["kept Default,after-keep,before", "replaced Default"], out.stderr[-2000:]
