"""Gang slots on the local engine with the capacity config on a real Prefect server (the session's test
harness): `traingate pools bootstrap`, the pool's authority admitting, capping and preempting. Jobs here hold
slots without training (threads standing in for orchestrators); tests/capacity/test_scheduling_e2e.py runs
the same path with real workers and real training."""

from __future__ import annotations

import contextvars
import threading
import time
import uuid

import pytest

from traingate.capacity.pools import CapacityError, parse_config
from traingate.job.stagejob import derive
from traingate.settings import Settings
from traingate.spec import load_spec


def _config(pool: str, **extra):
    return parse_config(
        {"pools": {pool: {"gpus_per_node": 2, "nodes": 2, "price_per_gpu_hour": 1.0, "worker": "process"}}, **extra}
    )


@pytest.fixture
def pool(prefect_harness):
    """A pool name of this test's own. The harness is shared by the session: the capacity config is removed
    after the test, or every later stage on it would be scheduled; the pool's authority is stopped."""
    from prefect import get_client

    from tasks import slots
    from traingate.capacity.authority import stop

    name = f"p{uuid.uuid4().hex[:8]}"
    yield name
    with get_client(sync_client=True) as c:
        slots.delete_variable(c, slots.CONFIG_VAR)
    stop(Settings.from_env().state_dir, name)


def _job(tiny_spec, tmp_path, pool: str, name: str, procs: int, team: str = "a", priority: str = "research"):
    spec = load_spec(
        tiny_spec(f"pools: {{{pool}: {{price_per_gpu_hour: 1.0}}}}\n", name=f"{name}.yaml"),
        [
            f"resources.work_pool={pool}",
            f"resources.procs_per_node={procs}",
            f"identity.team={team}",
            f"resources.priority={priority}",
        ],
    )
    return derive(spec, "full", run_id=name, run_dir=tmp_path / name, settings=Settings.from_env())


def _slots(job, cfg, said=None):
    from tasks.slots import GangSlots

    return GangSlots(job, cfg, (said if said is not None else []).append)


def _thread(target) -> threading.Thread:
    """A started daemon thread in this context (Prefect's settings - the harness's URL - are context variables)."""
    t = threading.Thread(target=contextvars.copy_context().run, args=(target,), daemon=True)
    t.start()
    return t


def _active(pool: str) -> int:
    """Slots the pool's authority has recorded as held (its signed records)."""
    from traingate.capacity import records
    from traingate.capacity.queue import RUNNING, Entry

    got = records.read_pool(Settings.from_env().state_dir, pool)
    assert not got.ignored, got.ignored
    return sum(
        e.slots for e in (Entry.from_json(v["entry"]) for v in got.of(records.ENTRY).values()) if e.state == RUNNING
    )


def test_bootstrap_creates_pool_queues_and_config_once_then_changes_nothing(pool, capsys):
    from prefect import get_client

    from flows.cli.pools import bootstrap
    from tasks import slots

    cfg = _config(pool, quotas={"vision": {pool: 2}})
    first = bootstrap(cfg)
    assert f"created work pool {pool} (process)" in first
    assert f"created work queue {pool}/urgent (priority 1)" in first
    assert not any("limit" in line for line in first)  # the pool's authority holds slots and quotas
    assert bootstrap(cfg) == []  # idempotent
    bigger = _config(pool, quotas={"vision": {pool: 3}})
    assert bootstrap(bigger) == [f"updated the capacity config (variable {slots.CONFIG_VAR})"]
    with get_client(sync_client=True) as c:
        queues = {q.name: q.priority for q in c.read_work_queues(work_pool_name=pool)}
        assert {k: v for k, v in queues.items() if k != "default"} == {"urgent": 1, "production": 2, "research": 3}
        assert slots.read_config(c) == bigger


def test_a_container_pool_without_a_pinned_image_is_refused_in_one_line(pool):
    from flows.cli.pools import bootstrap

    cfg = parse_config(
        {"pools": {pool: {"gpu": "A100", "gpus_per_node": 8, "nodes": 1, "price_per_gpu_hour": 1, "worker": "docker"}}}
    )
    with pytest.raises(CapacityError, match=r"needs the training image.*--image"):
        bootstrap(cfg)
    with pytest.raises(CapacityError, match="pin a tag"):
        bootstrap(cfg, image="ghcr.io/acme/train:latest")
    bootstrap(cfg, image="ghcr.io/acme/train:1.2.3")


def test_gang_jobs_never_exceed_the_pool_and_each_waits_for_all_its_slots(pool, tiny_spec, tmp_path):
    from flows.cli.pools import bootstrap

    cfg = _config(pool)
    bootstrap(cfg)
    jobs = [_job(tiny_spec, tmp_path, pool, f"j{i}", procs) for i, procs in enumerate([2, 1, 2, 1, 2])]
    peak, held, errors = [0], [0], []
    lock = threading.Lock()

    def run(job):
        try:
            g = _slots(job, cfg)
            assert g.acquire(lambda: None) is None
            with lock:
                held[0] += job.slots
                peak[0] = max(peak[0], held[0], _active(pool))
            time.sleep(1.5)
            with lock:
                held[0] -= job.slots
            g.release()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [_thread(lambda j=j: run(j)) for j in jobs]
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert 3 <= peak[0] <= 4 and _active(pool) == 0


def test_a_team_at_its_quota_waits_while_another_teams_job_starts(pool, tiny_spec, tmp_path):
    from flows.cli.pools import bootstrap

    cfg = _config(pool, quotas={"vision": {pool: 2}})
    bootstrap(cfg)
    first = _slots(_job(tiny_spec, tmp_path, pool, "v1", 2, team="vision"), cfg)
    assert first.acquire(lambda: None) is None
    said: list[str] = []
    second = _slots(_job(tiny_spec, tmp_path, pool, "v2", 1, team="vision"), cfg, said)
    got = threading.Event()
    _thread(lambda: (second.acquire(lambda: None), got.set()))
    other = _slots(_job(tiny_spec, tmp_path, pool, "s1", 2, team="speech"), cfg)
    assert other.acquire(lambda: None) is None  # the other team starts although vision's job waits
    assert not got.wait(3.0) and any("quota of 2" in s for s in said), said
    first.release()
    assert got.wait(30)
    second.release()
    other.release()
    assert _active(pool) == 0


def test_an_urgent_job_asks_the_least_costly_lower_class_job_to_stop_and_gets_its_slots(pool, tiny_spec, tmp_path):
    from flows.cli.pools import bootstrap

    cfg = _config(pool)
    bootstrap(cfg)
    research = [_slots(_job(tiny_spec, tmp_path, pool, f"r{i}", 2), cfg) for i in range(2)]
    for g in research:
        assert g.acquire(lambda: None) is None
    urgent = _slots(_job(tiny_spec, tmp_path, pool, "u", 2, priority="urgent"), cfg)
    got = threading.Event()
    _thread(lambda: (urgent.acquire(lambda: None), got.set()))
    deadline = time.monotonic() + 30
    asked = []
    while not asked and time.monotonic() < deadline:
        asked = [g for g in research if g.preempt_requested()]
        time.sleep(0.5)
    assert len(asked) == 1 and asked[0].preempted_by == "u-full"
    assert not got.is_set()
    (victim,) = asked
    victim.release(requeue=True)  # what run_stage_job does after the emergency checkpoint
    assert got.wait(30)
    back = threading.Event()
    _thread(lambda: (victim.acquire(lambda: None), back.set()))
    assert not back.wait(2.0)  # the pool is full: the victim waits in the queue
    urgent.release()
    assert back.wait(30)  # and comes back by itself
    victim.release()
    for g in research:
        if g is not victim:
            g.release()
    assert _active(pool) == 0


def test_a_job_wider_than_its_pool_is_refused_before_it_waits(pool, tiny_spec, tmp_path):
    from flows.cli.pools import bootstrap

    cfg = parse_config(
        {"pools": {pool: {"gpus_per_node": 1, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}}}
    )
    bootstrap(cfg)
    with pytest.raises(CapacityError, match=r"2 GPUs .*do not fit pool"):
        _slots(_job(tiny_spec, tmp_path, pool, "wide", 2), cfg)


def test_queue_view_shows_running_and_waiting_jobs_in_policy_order_with_position_and_reason(
    pool, tiny_spec, tmp_path, capsys
):
    import argparse

    from flows.cli import queue
    from flows.cli.pools import bootstrap

    cfg = _config(pool, quotas={"vision": {pool: 2}})
    bootstrap(cfg)
    running = _slots(_job(tiny_spec, tmp_path, pool, "big", 2, team="vision"), cfg)
    assert running.acquire(lambda: None) is None
    stop = threading.Event()
    waiters = [
        _slots(_job(tiny_spec, tmp_path, pool, name, procs, team=team, priority=prio), cfg)
        for name, procs, team, prio in [("late", 1, "vision", "research"), ("prod", 2, "speech", "production")]
    ]
    holders = []
    for g in waiters:
        _thread(
            lambda g=g: holders.append(g) if g.acquire(lambda: "stopped" if stop.is_set() else None) is None else None
        )
    deadline = time.monotonic() + 30
    while len(holders) < 1 and time.monotonic() < deadline:  # prod (2 free slots) starts; late waits on quota
        time.sleep(0.2)
    out = ""
    while "1 waiting" not in out and time.monotonic() < deadline:  # until late has published itself as waiting
        time.sleep(0.5)
        assert queue.main(argparse.Namespace(pool=pool)) == 0
        out = capsys.readouterr().out
    assert f"pool {pool}: 4/4 slots in use, 2 running, 1 waiting" in out, out
    assert "running  big-full" in out and "running  prod-full" in out
    assert "#1       late-full" in out and "quota of 2" in out, out
    stop.set()
    for g in [running, *holders]:
        g.release()


def test_queue_view_without_a_bootstrapped_server_says_what_to_run(prefect_harness, capsys):
    import argparse

    from prefect import get_client

    from flows.cli import queue
    from tasks import slots

    with get_client(sync_client=True) as c:
        assert slots.read_config(c) is None
    assert queue.main(argparse.Namespace(pool=None)) == 2
    assert "traingate pools bootstrap" in capsys.readouterr().err
