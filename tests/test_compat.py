"""The private APIs traingate relies on, pinned: one compat module per library, each checked here
against the installed version and against a real backend.

When a pin in pyproject.toml moves, the version test of that library fails first: re-check what
its compat module says it relies on, then move the module's PINNED with the pin.
"""
from __future__ import annotations

import ast
import inspect
import re
import time
import tomllib
import uuid
from importlib.metadata import version

import pytest

from tgtest import ROOT

COMPAT_MODULES = {"prefect": "tasks/compat_prefect.py", "mlflow": "traingate/tracking/compat_mlflow.py",
                  "optuna": "traingate/sweep/compat_optuna.py", "torch": "traingate/runtime/compat_torch.py"}
# The private names the compat modules wrap: nothing else may reach for them directly.
PRIVATE_NAMES = {"_trial_id", "_storage", "_tracking_client", "_metric_objs", "_terminate_process_handler", "_delay"}


def _pin(dist: str) -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.fullmatch(rf"{dist}(?:\[[\w,]+\])?==([\w.]+)", d.split(";")[0].strip()))]
    assert len(pins) == 1, f"pyproject.toml must pin {dist} exactly once with ==, found {pins}"
    return pins[0]


@pytest.mark.parametrize("dist, module", [("prefect", "tasks.compat_prefect"),
                                          ("mlflow", "traingate.tracking.compat_mlflow"),
                                          ("optuna", "traingate.sweep.compat_optuna")])
def test_each_compat_module_is_written_for_the_installed_pinned_version(dist, module):
    import importlib

    pinned = importlib.import_module(module).PINNED
    assert version(dist) == _pin(dist) == pinned, (
        f"{dist}: installed {version(dist)}, pyproject pins {_pin(dist)}, {module} was checked against {pinned}; "
        f"re-check what {module} relies on before moving its PINNED")


def test_torch_compat_module_is_written_for_the_installed_pinned_version():
    from traingate.runtime import compat_torch

    installed = version("torch").split("+")[0]  # the CPU wheel's local label (+cpu) is not part of the pin
    assert installed == _pin("torch") == compat_torch.PINNED, (
        f"torch: installed {installed}, pyproject pins {_pin('torch')}, traingate.runtime.compat_torch was checked "
        f"against {compat_torch.PINNED}; re-check what it relies on before moving its PINNED")


def test_one_node_rendezvous_keeps_its_event_names_and_drops_only_the_start_up_jitter(monkeypatch):
    from torch.distributed.elastic.multiprocessing import api as elastic_api
    from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from traingate.runtime import compat_torch

    assert compat_torch.torch_terminate_handler is elastic_api._terminate_process_handler
    names: list[str] = []
    delays: list[object] = []
    record = dynamic_rendezvous.construct_and_record_rdzv_event
    monkeypatch.setattr(dynamic_rendezvous, "construct_and_record_rdzv_event",
                        lambda **kw: (names.append(kw["name"]), record(**kw))[1])
    monkeypatch.setattr(dynamic_rendezvous, "_delay", lambda seconds: delays.append(seconds))
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)

    def two_rounds(run_id: str) -> tuple[list[str], list[object]]:
        names.clear()
        delays.clear()
        handler = get_rendezvous_handler(RendezvousParameters(
            backend="c10d", endpoint="localhost:0", run_id=run_id, min_nodes=1, max_nodes=1, timeout=60))
        try:
            ranks = [handler.next_rendezvous().rank for _ in range(2)]  # the group's start and its first restart
        finally:
            handler.shutdown()
        assert ranks == [0, 0]
        return list(names), list(delays)

    torch_names, torch_delays = two_rounds(f"compat-{uuid.uuid4().hex[:8]}")
    assert torch_delays == [(0, 0.3), (0, 0.3)]  # round 0 jitters twice: the start and the first restart
    compat_torch.fast_one_node_rendezvous()
    fast_names, fast_delays = two_rounds(f"compat-{uuid.uuid4().hex[:8]}")
    assert fast_delays == []
    assert fast_names == torch_names and "DynamicRendezvousHandler.next_rendezvous" in fast_names


def test_prefect_lease_api_holds_renews_and_releases_slots_as_the_sweep_uses_it(prefect_harness):
    from prefect import get_client
    from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError

    from tasks import compat_prefect as cp

    assert {"lease_duration", "strict"} <= set(inspect.signature(cp.acquire_concurrency_slots_with_lease).parameters)
    assert "raise_on_lease_renewal_failure" in inspect.signature(cp.maintain_concurrency_lease).parameters
    name = f"compat-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as c:
        c.upsert_global_concurrency_limit_by_name(name, 3)

        def active() -> int:
            return c.read_global_concurrency_limit_by_name(name).active_slots

        resp = cp.acquire_concurrency_slots_with_lease([name], 2, lease_duration=60, strict=True)
        lease = str(resp.lease_id)  # stored on the Optuna trial as a string
        assert uuid.UUID(lease) and active() == 2  # both slots at once (the gang)
        with cp.maintain_concurrency_lease(resp.lease_id, 60, raise_on_lease_renewal_failure=False):
            time.sleep(0.5)  # the renewal thread's first renewal
            assert active() == 2
        assert active() == 2  # leaving the renewal block does not release
        cp.release_concurrency_slots_with_lease(lease)
        assert active() == 0
        # A lease that is gone (released, or expired and reclaimed) releases as a no-op, not an error:
        # re-queueing a trial whose slots already came back must not fail.
        cp.release_concurrency_slots_with_lease(lease)
        cp.release_concurrency_slots_with_lease(str(uuid.uuid4()))
        assert active() == 0
        with pytest.raises(ConcurrencySlotAcquisitionError, match="must be created before acquiring"):
            cp.acquire_concurrency_slots_with_lease([f"missing-{name}"], 1, lease_duration=60, strict=True)


def test_mlflow_client_builds_its_store_when_made_and_latest_metrics_carry_their_steps(tmp_path):
    import sqlite3

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from traingate.tracking import compat_mlflow

    # The tracker relies on this to keep building the store (engine, schema) off its writer thread.
    db = tmp_path / "mlflow.db"
    client = MlflowClient(f"sqlite:///{db}")
    with sqlite3.connect(db) as con:
        assert con.execute("select count(*) from sqlite_master where name = 'runs'").fetchone() == (1,)

    exp = client.create_experiment("compat", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    client.log_batch(run_id, metrics=[Metric("loss", 1.0 / s, 0, s) for s in (1, 2, 3)]
                     + [Metric("acc", 0.5, 0, 7)])
    latest = {m.key: (m.step, m.value) for m in compat_mlflow.latest_metrics(client.get_run(run_id))}
    assert latest == {"loss": (3, 1.0 / 3), "acc": (7, 0.5)}


def test_mlflows_schema_head_is_what_a_new_store_is_stamped_with_and_stays_cached(tmp_path):
    import sqlite3

    import mlflow.store.db.utils as db_utils
    from mlflow.tracking import MlflowClient

    from traingate.tracking import compat_mlflow

    head = compat_mlflow.cache_schema_head(db_utils)
    db = tmp_path / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()  # a new store: created at MLflow's newest revision
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone()[0] == head
    assert db_utils._get_latest_schema_revision.cache_info().currsize == 1
    assert compat_mlflow.cache_schema_head(db_utils) == head



def test_mlflow_keeps_one_store_per_uri_whose_sql_engines_are_reached_and_forgotten_as_traingate_does(tmp_path):
    import mlflow.tracking
    import sqlalchemy
    from mlflow.tracking import MlflowClient

    from traingate.tracking import compat_mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = MlflowClient(uri)
    engines = compat_mlflow.sql_engines(first)
    assert len(engines) == 2 and all(isinstance(e, sqlalchemy.engine.Engine) for e in engines)  # tracking, registry
    # A client holds no store: each call asks MLflow's per-URI cache.
    stores = (first._tracking_client.store, first._get_registry_client().store)
    assert (MlflowClient(uri)._tracking_client.store, MlflowClient(uri)._get_registry_client().store) == stores
    compat_mlflow.forget_stores(mlflow.tracking)
    again = MlflowClient(uri)
    assert again._tracking_client.store is not stores[0]  # opened anew
    assert again._get_registry_client().store is not stores[1]

def test_optuna_trial_ids_storage_and_requeue_record_behave_as_the_sweep_uses_them(tmp_path):
    import warnings

    import optuna
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    from traingate.sweep import compat_optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(
            f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_interval=1, grace_period=1,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="compat", storage=storage)
    other = optuna.create_study(study_name="compat-other", storage=storage)
    other.ask()
    trial = study.ask()
    beats = compat_optuna.storage(study)  # a caching wrapper around the RDB storage, heartbeat API included
    assert beats.get_heartbeat_interval() == 1
    tid = compat_optuna.trial_id(trial)
    assert tid != trial.number  # unique across the storage's studies, unlike the number
    rebuilt = optuna.trial.Trial(study, tid)  # how a trial's subflow gets its live trial back
    assert rebuilt.number == trial.number
    assert compat_optuna.trial_id(study.trials[0]) == tid  # a FrozenTrial carries it too

    beats.record_heartbeat(tid)
    time.sleep(2.2)  # past the grace period: the trial's driver is "dead"
    optuna.storages.fail_stale_trials(study)  # what study.ask() does on its own
    requeued = study.ask()
    assert compat_optuna.trial_system_attrs(requeued)["failed_trial"] == trial.number
    assert compat_optuna.trial_system_attrs(study.ask()).get("failed_trial") is None


def _private_uses(path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for m in modules:
            parts = m.split(".")
            if parts[0] in COMPAT_MODULES and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {m}")
        own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES and not own:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses .{node.attr}")
    return found


def test_no_module_outside_the_compat_modules_touches_a_private_api():
    compat = {ROOT / p for p in COMPAT_MODULES.values()}
    found = [use for pkg in ("traingate", "flows", "tasks") for path in sorted((ROOT / pkg).rglob("*.py"))
             if path not in compat for use in _private_uses(path)]
    assert not found, "private API of prefect/mlflow/optuna/torch outside its compat module:\n" + "\n".join(found)
    # The scan itself finds what it is meant to find.
    assert all(_private_uses(ROOT / p) for p in COMPAT_MODULES.values())
