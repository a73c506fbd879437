"""Checkpointer against real files in tmp dirs: atomic layout, async saves, retention, refusal of bad files."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
import threading
import time

import pytest
import torch

from traingate.runtime.checkpoint import (MANIFEST, CheckpointError, Checkpointer, CheckpointRefused,
                                          RetentionPolicy, step_dir)


def _state(value: float, n: int = 4) -> dict:
    model = torch.nn.Linear(n, n)
    with torch.no_grad():
        model.weight.fill_(value)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, n)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "train_state": {"optimizer": opt.state_dict(), "step": int(value)}}


class Gate:
    """A fault hook that holds the writer thread at ``tensor_write`` until released."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, phase: str, step: int) -> None:
        if phase == "tensor_write":
            self.entered.set()
            assert self.release.wait(30)


def test_save_returns_after_the_snapshot_and_later_training_updates_do_not_leak_into_it(tmp_path):
    gate = Gate()
    ck = Checkpointer(tmp_path.as_uri(), fault_hook=gate)
    w = torch.zeros(1000)
    assert ck.save(1, {"model": {"w": w}}) is True
    assert gate.entered.wait(10)  # the write is in flight, held
    assert ck.find_latest() is None  # no manifest yet: not a checkpoint
    w.add_(1.0)  # training goes on and updates the weights in place
    gate.release.set()
    ck.close()
    assert ck.find_latest() == 1
    assert torch.equal(ck.load(1)["model"]["w"], torch.zeros(1000))


def test_a_save_due_while_one_is_in_flight_waits_for_it_by_default(tmp_path):
    gate = Gate()
    ck = Checkpointer(tmp_path.as_uri(), fault_hook=gate)
    ck.save(1, _state(1.0))
    assert gate.entered.wait(10)
    second = threading.Thread(target=ck.save, args=(2, _state(2.0)))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second save did not wait for the one in flight"
    assert not (tmp_path / step_dir(2)).exists()  # never interleaved
    gate.release.set()
    second.join(30)
    ck.close()
    assert ck.list_steps() == [1, 2]


def test_skip_policy_skips_a_save_while_one_is_in_flight(tmp_path):
    gate = Gate()
    ck = Checkpointer(tmp_path.as_uri(), fault_hook=gate, in_flight="skip")
    ck.save(1, _state(1.0))
    assert gate.entered.wait(10)
    assert ck.save(2, _state(2.0)) is False
    gate.release.set()
    ck.wait()
    assert ck.save(3, _state(3.0)) is True
    ck.close()
    assert ck.list_steps() == [1, 3] and ck.saves_skipped == 1


def test_skip_policy_never_skips_an_emergency_or_final_save(tmp_path):
    gate = Gate()
    ck = Checkpointer(tmp_path.as_uri(), fault_hook=gate, in_flight="skip")
    ck.save(1, _state(1.0))
    assert gate.entered.wait(10)
    threading.Timer(0.3, gate.release.set).start()
    assert ck.save(2, _state(2.0), force=True) is True  # waits for step 1 instead
    ck.close()
    assert ck.list_steps() == [1, 2]


def test_a_directory_without_a_manifest_is_not_a_checkpoint(tmp_path):
    ck = Checkpointer(tmp_path.as_uri(), async_save=False)
    ck.save(4, _state(4.0))
    torn = tmp_path / step_dir(8)
    torn.mkdir()
    (torn / "model.pt").write_bytes(b"half a tensor")
    assert ck.list_steps() == [4] and ck.find_latest() == 4
    with pytest.raises(CheckpointError, match="no valid manifest"):
        ck.load(8)


def test_a_newest_checkpoint_failing_its_checksum_is_skipped_with_a_warning(tmp_path, caplog):
    ck = Checkpointer(tmp_path.as_uri(), async_save=False)
    ck.save(1, _state(1.0))
    ck.save(2, _state(2.0))
    f = tmp_path / step_dir(2) / "model.pt"
    f.write_bytes(f.read_bytes()[:-10] + b"0123456789")  # bit rot
    with caplog.at_level(logging.WARNING):
        assert ck.find_latest() == 1
        step, state = ck.load_latest()
    assert step == 1 and state["train_state"]["step"] == 1
    assert "fails its sha256 check" in caplog.text
    with pytest.raises(CheckpointError, match="sha256"):
        ck.load(2)


class _Payload:
    """What an attacker would put in a checkpoint: unpickling it runs code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_a_checkpoint_carrying_a_malicious_pickle_is_refused_and_the_payload_never_runs(tmp_path):
    root, marker = tmp_path / "ckpts", tmp_path / "pwned"
    ck = Checkpointer(root.as_uri(), async_save=False)
    ck.save(1, _state(1.0))
    # A forged step 2 whose manifest checks out: checksums cannot catch a writer that lies.
    d = root / step_dir(2)
    d.mkdir()
    torch.save({"weight": torch.ones(2), "extra": _Payload(str(marker))}, d / "model.pt")
    data = (d / "model.pt").read_bytes()
    (d / MANIFEST).write_text(json.dumps({"format": 1, "step": 2, "files": {
        "model.pt": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}}))

    with pytest.raises(CheckpointRefused, match="outside the weights-only allowlist"):
        ck.load(2)
    with pytest.raises(CheckpointRefused):
        ck.load_latest()  # never silently fallen back past
    assert not marker.exists(), "the pickle payload was executed"
    # The payload is armed: a plain unpickler would have run it.
    torch.load(d / "model.pt", weights_only=False)
    assert marker.exists()


@pytest.fixture(params=["injected", "tmpfs"])
def full_disk(request, tmp_path):
    """A checkpoint root where the second, larger save runs out of space.

    ``tmpfs``: a real 1 MiB filesystem (needs root and mount(2); skipped elsewhere).
    ``injected``: the writer gets ENOSPC from the OS layer in the middle of a file.
    """
    root = tmp_path / "small"
    root.mkdir()
    if request.param == "tmpfs":
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        yield root, None
        subprocess.run(["umount", str(root)], check=True)
        return

    def enospc(phase: str, step: int) -> None:
        if phase == "tensor_write" and step == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    yield root, enospc


def test_disk_full_during_a_save_gives_a_clear_error_and_keeps_the_previous_checkpoint(full_disk):
    root, hook = full_disk
    ck = Checkpointer(root.as_uri(), fault_hook=hook)
    small = {"model": {"w": torch.ones(1000)}}
    ck.save(1, small)
    ck.wait()
    ck.save(2, {"model": {"w": torch.ones(2_000_000)}})  # 8 MB: does not fit in 1 MiB
    with pytest.raises(CheckpointError) as err:
        ck.wait()
    msg = str(err.value)
    assert "No space left on device" in msg and "previous checkpoint step_00000001 kept" in msg
    assert not (root / step_dir(2)).exists()  # the partial files are gone, and their space with them
    assert ck.find_latest() == 1 and torch.equal(ck.load(1)["model"]["w"], torch.ones(1000))
    ck.save(3, small)  # once space is back, saving works again
    ck.close()
    assert ck.list_steps() == [1, 3]


def test_retention_keeps_the_last_k_every_mth_and_the_best_by_metric(tmp_path):
    policy = RetentionPolicy(keep_last=2, keep_every=4, keep_best=1, best_metric="train_loss")
    ck = Checkpointer(tmp_path.as_uri(), policy, async_save=False)
    losses = {1: 0.9, 2: 0.8, 3: 0.1, 4: 0.7, 5: 0.6, 6: 0.5, 7: 0.4, 8: 0.3}
    for step, loss in losses.items():
        ck.save(step, {"model": {"w": torch.full((2,), float(step))}}, {"metrics": {"train_loss": loss}})
    assert ck.list_steps() == [3, 4, 7, 8]
    assert RetentionPolicy(keep_last=1, keep_best=2, best_mode="max").keep([1, 2, 3], {1: 5.0, 2: 1.0, 3: 3.0}) == {1, 3}


def test_retention_removes_older_debris_of_killed_saves(tmp_path):
    ck = Checkpointer(tmp_path.as_uri(), RetentionPolicy(keep_last=2), async_save=False)
    ck.save(1, _state(1.0))
    (tmp_path / step_dir(2)).mkdir()  # a save killed before its manifest
    for s in (3, 4):
        ck.save(s, _state(float(s)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(3), step_dir(4)]


def test_a_rewritten_step_never_shows_its_old_manifest_over_new_files(tmp_path):
    hits = []

    def look(phase: str, step: int) -> None:
        if phase == "tensor_write":
            hits.append((tmp_path / step_dir(step) / MANIFEST).exists())

    ck = Checkpointer(tmp_path.as_uri(), async_save=False, fault_hook=look)
    first, second = _state(1.0), _state(2.0)
    first["train_state"]["step"] = second["train_state"]["step"] = 5
    ck.save(5, first)
    ck.save(5, second)  # a resumed run reaching the step again
    assert hits == [False, False, False, False]
    assert torch.equal(ck.load(5)["model"]["weight"], second["model"]["weight"])


def test_snapshot_buffers_are_reused_between_saves(tmp_path):
    ck = Checkpointer(tmp_path.as_uri())
    w = torch.zeros(10_000)
    ck.save(1, {"model": {"w": w}})
    ck.wait()
    first = ck._host._lent[0][1].data_ptr()
    w.add_(1.0)
    ck.save(2, {"model": {"w": w}})
    ck.close()
    assert ck._host._lent[0][1].data_ptr() == first
    assert torch.equal(ck.load(1)["model"]["w"], torch.zeros(10_000))
    assert torch.equal(ck.load(2)["model"]["w"], torch.ones(10_000))


def test_prepared_buffers_are_the_ones_the_first_snapshot_copies_into(tmp_path):
    gate = Gate()
    ck = Checkpointer(tmp_path.as_uri(), fault_hook=gate)
    model = {"w": torch.zeros(3, 1000), "b": torch.zeros(3)}
    ck.prepare(model, copies=3)  # the model's tensors and two optimizer moments of the same shapes
    ck._await_prepared()
    reserved = {b.data_ptr() for free in ck._host._free.values() for b in free}
    assert len(reserved) == 6 and ck.prepare_s is not None
    moments = {"m1": torch.ones(3, 1000), "m2": torch.full((3, 1000), 2.0)}
    ck.save(1, {"model": model, "train_state": {"optimizer": moments, "step": 1}})
    assert gate.entered.wait(10)
    assert {b.data_ptr() for _, b in ck._host._lent} <= reserved  # no allocation in the first snapshot
    gate.release.set()
    ck.close()
    state = ck.load(1)
    assert torch.equal(state["train_state"]["optimizer"]["m2"], torch.full((3, 1000), 2.0))
    assert torch.equal(state["model"]["w"], torch.zeros(3, 1000))


def test_a_save_due_while_buffers_are_being_prepared_waits_for_them(tmp_path):
    release = threading.Event()
    ck = Checkpointer(tmp_path.as_uri())
    ck._pool.submit(release.wait, 30)  # hold the writer thread so that prepare is still queued
    ck.prepare({"w": torch.zeros(1000)})
    saver = threading.Thread(target=ck.save, args=(1, {"model": {"w": torch.ones(1000)}}))
    saver.start()
    saver.join(0.5)
    assert saver.is_alive(), "the save did not wait for prepare"
    release.set()
    saver.join(30)
    ck.close()
    assert torch.equal(ck.load(1)["model"]["w"], torch.ones(1000))


def test_blocked_time_is_recorded_per_save(tmp_path):
    ck = Checkpointer(tmp_path.as_uri())
    t0 = time.perf_counter()
    ck.save(1, _state(1.0))
    assert 0 < ck.last_blocked_s <= time.perf_counter() - t0
    ck.close()
