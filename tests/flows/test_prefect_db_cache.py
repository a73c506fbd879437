"""The cache of migrated, empty Prefect databases (flows.local_server.seed_database): a Prefect server started on
a new SQLite file starts on a copy instead of migrating its own. Real SQLite files; the end-to-end test starts
real temporary servers the way `traingate run` does, in CLI-like subprocesses."""

from __future__ import annotations

import contextlib
import doctest
import json
import os
import sqlite3
import stat
import subprocess
from pathlib import Path

import pytest
from tgtest import PYTHON, ROOT

from flows import local_server


def _database(path: Path, rows: dict[str, int]) -> Path:
    """A SQLite file with ``rows[table]`` rows in each table."""
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        for table, n in rows.items():
            db.execute(f'CREATE TABLE "{table}" (x INTEGER)')
            db.executemany(f'INSERT INTO "{table}" VALUES (?)', [(i,) for i in range(n)])
    return path


def _tables(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_the_module_doctests_pass():
    assert doctest.testmod(local_server).failed == 0


def test_a_new_database_is_a_0600_copy_of_the_cached_one_and_its_server_skips_migrations_and_block_registration(
    tmp_path,
):
    cache = tmp_path / "cache"
    cache.mkdir()
    _database(cache / "k.db", {"alembic_version": 1, "block_type": 3})
    seeding = local_server.seed_database(tmp_path / "home" / "prefect.db", cache, key="k.db")
    assert seeding.env == local_server.SEEDED_SERVER_ENV
    assert _tables(tmp_path / "home" / "prefect.db") == {"alembic_version", "block_type"}
    assert stat.S_IMODE((tmp_path / "home" / "prefect.db").stat().st_mode) == 0o600
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["prefect.db"]  # no temporary copy left


def test_an_existing_database_is_used_as_it_is_and_never_cached(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    _database(cache / "k.db", {"alembic_version": 1})
    db = _database(tmp_path / "prefect.db", {"alembic_version": 1, "flow_run": 2})
    seeding = local_server.seed_database(db, cache, key="k.db")
    assert seeding.env == {} and not seeding.created
    assert _tables(db) == {"alembic_version", "flow_run"}
    seeding = local_server.seed_database(db, tmp_path / "empty-cache", key="k.db")
    seeding.started()
    assert not (tmp_path / "empty-cache").exists()


def test_a_database_its_server_made_is_cached_only_while_it_holds_nothing_but_what_a_start_writes(tmp_path):
    cache = tmp_path / "cache"
    made = local_server.seed_database(tmp_path / "a" / "prefect.db", cache, key="k.db")
    assert made.env == {} and made.created
    _database(made.db, {"alembic_version": 1, "block_type": 2, "flow_run": 1})  # a client wrote a flow run
    made.started()
    assert not (cache / "k.db").exists()
    made = local_server.seed_database(tmp_path / "b" / "prefect.db", cache, key="k.db")
    _database(made.db, {"alembic_version": 1, "block_type": 2, "block_schema": 2, "flow_run": 0})
    made.started()
    assert _tables(cache / "k.db") == {"alembic_version", "block_type", "block_schema", "flow_run"}
    assert stat.S_IMODE((cache / "k.db").stat().st_mode) == 0o600
    assert sorted(p.name for p in cache.iterdir()) == ["k.db"]


# What `traingate run`, `resume`, `sweep`, `ci` and `retrain` do before their flow: the temporary server started
# (flows.cli.run), then a client that reads the server's block types and writes a flow.
CLI_START = """
import json
from flows.cli.run import _start_prefect_server_shielded
_start_prefect_server_shielded()
from prefect import get_client
with get_client(sync_client=True) as client:
    block_types = len(client.read_block_types())
    client.create_flow_from_name("cache-check")
print(json.dumps({"block_types": block_types}))
"""


@pytest.mark.slow  # two temporary Prefect servers, each in a CLI-like process (5-15 s each on a loaded 2-core box)
def test_a_second_temporary_server_starts_from_the_cached_database_and_a_changed_key_does_not_use_a_stale_one(
    tmp_path,
):
    cache = tmp_path / "cache"
    cache.mkdir()
    key = local_server.db_cache_key()
    # A database cached for another Prefect (or another set of collections): never a server's.
    _database(cache / "prefect-0.0.1-000000000000.db", {"alembic_version": 1, "stale_marker": 1})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
    env.update(TRAINGATE_STATE_DIR=str(tmp_path / "state"), TRAINGATE_PREFECT_SERVER="temporary",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180", **{local_server.CACHE_VAR: str(cache)})

    def start(home: str) -> dict:
        p = subprocess.run([PYTHON, "-c", CLI_START], cwd=ROOT, env={**env, "PREFECT_HOME": str(tmp_path / home)},
                           capture_output=True, text=True, timeout=400)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    first = start("home-1")
    assert "stale_marker" not in _tables(tmp_path / "home-1" / "prefect.db")
    assert first["block_types"] > 0
    # The first server migrated its own database; the snapshot taken as it answered is the current key's entry.
    assert sorted(p.name for p in cache.iterdir()) == sorted([key, "prefect-0.0.1-000000000000.db"])
    assert "flow" in _tables(cache / key)
    with contextlib.closing(sqlite3.connect(cache / key)) as db, db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # one file: a byte copy is whole
        assert db.execute("SELECT count(*) FROM flow").fetchone()[0] == 0  # taken before the client wrote
        db.execute("CREATE TABLE cache_marker (x INTEGER)")
    second = start("home-2")
    # The second server's database is the cached copy (its marker table), and the server on it works: the
    # block types the copy holds are served and a flow is written, without migrations or block registration.
    assert "cache_marker" in _tables(tmp_path / "home-2" / "prefect.db")
    assert second["block_types"] == first["block_types"]
