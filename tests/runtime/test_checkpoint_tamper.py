"""Tampered or crossed checkpoints are refused, on file:// and on s3:// (a real S3 endpoint on loopback).

Each case runs on both backends, except those about symbolic links, which exist only on a
file system: their ids say ``file-only-symlinks``. The last test goes through a real
``python -m traingate.runtime.train`` process.
"""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from resume_drill import Drill, write_spec
from tgtest import TINY_DIGITS
from traingate.runtime import exitcodes
from traingate.runtime.checkpoint import MANIFEST, Checkpointer, CheckpointRefused, step_dir
from traingate.storage import Storage
from traingate.spec import load_spec, load_spec_text

SPEC = load_spec_text(TINY_DIGITS)
MINE = {"run_id": "run-mine", "stage": "full", "spec": SPEC}


def _state(step: int, fill: float) -> dict:
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(fill)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "train_state": {"optimizer": opt.state_dict(), "step": step}}


@pytest.fixture(params=["file", "s3"])
def roots(request, tmp_path):
    """name -> checkpoint root URI on the backend under test."""
    if request.param == "s3":
        request.getfixturevalue("s3_server")
        # moto keeps objects in process memory across servers: a prefix of this test's own.
        return lambda name: f"s3://tg-test/{tmp_path.name}/{name}"
    return lambda name: (tmp_path / name).as_uri()


def _local(uri: str):
    from pathlib import Path

    return Path(uri.removeprefix("file://"))


def _forge_manifest(uri: str, step: int, files: dict[str, dict], **extra) -> None:
    """Write a manifest for ``step`` under ``uri`` (as someone who can write there, but not through us)."""
    manifest = {"format": 1, "step": step, "files": files, **extra}
    Storage(uri).write_bytes(f"{step_dir(step)}/{MANIFEST}", json.dumps(manifest).encode())


def _entry(data: bytes) -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _mine_with_a_victim_next_door(roots) -> tuple[Checkpointer, str, bytes]:
    """My run has a good step 4; another run has step 4 too. Returns (mine, victim uri, victim's model bytes)."""
    victim = Checkpointer(roots("victim"), async_save=False, run_id="run-victim", stage="full", spec=SPEC)
    victim.save(4, _state(4, 7.0))
    mine = Checkpointer(roots("mine"), async_save=False, **MINE)
    mine.save(4, _state(4, 1.0))
    return mine, roots("victim"), Storage(roots("victim")).read_bytes(f"{step_dir(4)}/model.pt")


# ---------------------------------------------------------------------------------------- manifest entries
def test_a_manifest_entry_climbing_out_with_dot_dot_is_refused_and_no_older_checkpoint_is_used(roots):
    mine, _, victim_model = _mine_with_a_victim_next_door(roots)
    own = Storage(mine.uri).read_bytes(f"{step_dir(4)}/train_state.pt")
    Storage(mine.uri).write_bytes(f"{step_dir(8)}/train_state.pt", own)
    _forge_manifest(mine.uri, 8, {f"../../victim/{step_dir(4)}/model.pt": _entry(victim_model),
                                  "train_state.pt": _entry(own)})
    with pytest.raises(CheckpointRefused) as e:
        mine.load_latest()
    assert f"'../../victim/{step_dir(4)}/model.pt', not a plain file of {step_dir(8)}" in _one_line(e)
    with pytest.raises(CheckpointRefused):
        mine.find_latest()  # not skipped in favour of step 4 either


def test_a_manifest_entry_with_an_absolute_path_is_refused(roots):
    mine, victim_uri, victim_model = _mine_with_a_victim_next_door(roots)
    absolute = (str(_local(victim_uri)) if victim_uri.startswith("file://")
                else "/" + victim_uri.removeprefix("s3://")) + f"/{step_dir(4)}/model.pt"
    _forge_manifest(mine.uri, 8, {absolute: _entry(victim_model)})
    with pytest.raises(CheckpointRefused) as e:
        mine.load(8)
    assert f"lists {absolute!r}, not a plain file" in _one_line(e)


# ---------------------------------------------------------------------------------------- symbolic links
@pytest.mark.parametrize("roots", ["file"], indirect=True, ids=["file-only-symlinks"])
def test_a_symlinked_file_inside_a_checkpoint_is_refused_even_when_its_checksum_matches(roots):
    mine, victim_uri, victim_model = _mine_with_a_victim_next_door(roots)
    mine.save(8, _state(8, 1.0))
    d = _local(mine.uri) / step_dir(8)
    (d / "model.pt").unlink()
    (d / "model.pt").symlink_to(_local(victim_uri) / step_dir(4) / "model.pt")
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["files"]["model.pt"] = _entry(victim_model)
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointRefused) as e:
        mine.load_latest()
    assert "model.pt is a symbolic link" in _one_line(e) and "it is not followed" in str(e.value)


@pytest.mark.parametrize("roots", ["file"], indirect=True, ids=["file-only-symlinks"])
def test_a_symlinked_step_directory_is_refused_when_listing_and_loading(roots):
    mine, victim_uri, _ = _mine_with_a_victim_next_door(roots)
    Checkpointer(victim_uri, async_save=False, run_id="run-victim", stage="full", spec=SPEC).save(8, _state(8, 7.0))
    (_local(mine.uri) / step_dir(8)).symlink_to(_local(victim_uri) / step_dir(8))
    for look in (mine.list_steps, mine.find_latest, mine.load_latest, lambda: mine.load(8)):
        with pytest.raises(CheckpointRefused) as e:
            look()
        assert f"{step_dir(8)} refused: it is a symbolic link to " in _one_line(e)


@pytest.mark.parametrize("roots", ["file"], indirect=True, ids=["file-only-symlinks"])
@pytest.mark.parametrize("planted", ["model.pt", MANIFEST, "step directory"])
def test_a_save_over_a_planted_symlink_replaces_the_link_and_leaves_its_target_untouched(roots, planted):
    mine, victim_uri, _ = _mine_with_a_victim_next_door(roots)
    victim_dir = _local(victim_uri) / step_dir(4)
    before = {p.name: p.read_bytes() for p in victim_dir.iterdir()}
    target = _local(mine.uri) / step_dir(8)
    if planted == "step directory":
        target.symlink_to(victim_dir)
    else:
        target.mkdir()
        (target / planted).symlink_to(victim_dir / planted)
    mine.save(8, _state(8, 2.0))
    assert {p.name: p.read_bytes() for p in victim_dir.iterdir()} == before, "the save wrote through the link"
    assert not target.is_symlink() and not any(p.is_symlink() for p in target.iterdir())
    assert mine.load_latest()[0] == 8


# ---------------------------------------------------------------------------------------- crossed identity
@pytest.mark.parametrize("reader, reason", [
    ({"run_id": "run-other"}, "it belongs to run 'run-mine', not to this run 'run-other'"),
    ({"stage": "canary"}, "it was written by stage 'full' of run 'run-mine', not by stage 'canary'"),
    ({"spec": load_spec_text(TINY_DIGITS, ["optim.lr=0.1"])},
     "written under an incompatible spec (optim.lr: 0.05 in the checkpoint, 0.1 now)"),
    ({"spec": load_spec_text(TINY_DIGITS, ["recipe.params.hidden=64", "optim.seed=3"])},
     'written under an incompatible spec (optim.seed: 0 in the checkpoint, 3 now; recipe.params: '
     '{"channels": 8, "hidden": 32} in the checkpoint, {"channels": 8, "hidden": 64} now)'),
], ids=["another-run", "another-stage", "another-lr", "another-model-and-seed"])
def test_a_checkpoint_of_another_run_stage_or_incompatible_spec_is_refused_in_one_line(roots, reader, reason):
    writer = Checkpointer(roots("ck"), async_save=False, **MINE)
    writer.save(4, _state(4, 1.0))
    writer.save(8, _state(8, 1.0))
    ck = Checkpointer(roots("ck"), async_save=False, **(MINE | reader))
    with pytest.raises(CheckpointRefused) as e:
        ck.load_latest()  # step 4 is just as foreign: no fall back
    msg = _one_line(e)
    assert msg.startswith(f"checkpoint {roots('ck')}/{step_dir(8)} refused: {reason}. ")
    assert "Checkpointer.init_from" in msg


def test_a_checkpoint_without_a_run_identity_is_refused_by_a_resuming_run_but_readable_by_tools(roots):
    Checkpointer(roots("ck"), async_save=False).save(4, _state(4, 1.0))  # a tool: no identity stamped
    with pytest.raises(CheckpointRefused, match="carries no run identity"):
        Checkpointer(roots("ck"), async_save=False, **MINE).load_latest()
    assert Checkpointer(roots("ck"), async_save=False).load_latest()[0] == 4


def test_a_state_whose_step_differs_from_its_manifest_step_is_refused(roots):
    ck = Checkpointer(roots("ck"), async_save=False, **MINE)
    ck.save(4, _state(4, 1.0))
    # Step 4 passed off as step 12: every file and checksum intact, only the manifest's step changed.
    st = Storage(ck.uri)
    manifest = json.loads(st.read_bytes(f"{step_dir(4)}/{MANIFEST}"))
    for fname in manifest["files"]:
        st.write_bytes(f"{step_dir(12)}/{fname}", st.read_bytes(f"{step_dir(4)}/{fname}"))
    st.write_bytes(f"{step_dir(12)}/{MANIFEST}", json.dumps(manifest | {"step": 12}).encode())
    with pytest.raises(CheckpointRefused) as e:
        ck.load_latest()
    assert "its state is at step 4 but its manifest says 12 (renamed or tampered)" in _one_line(e)


def test_an_oom_style_batch_change_and_new_supervision_settings_still_resume(roots):
    Checkpointer(roots("ck"), async_save=False, **MINE).save(4, _state(4, 1.0))
    restarted = load_spec_text(TINY_DIGITS, [
        "optim.batch_size=8", "optim.grad_accum=2",  # what supervision.oom_halve_batch does
        "supervision.max_restarts=1", "tracking.enabled=false", "budget.max_cost_usd=3",
        "stages.full.timeout_s=60", "stages.full.max_steps=40", "checkpoint.keep_last=1"])
    assert restarted.spec_hash() != SPEC.spec_hash()
    step, state = Checkpointer(roots("ck"), async_save=False, **(MINE | {"spec": restarted})).load_latest()
    assert step == 4 and state["train_state"]["step"] == 4


# ---------------------------------------------------------------------------------------- deliberate warm start
def test_init_from_copies_another_runs_checkpoint_restamped_for_the_destination(roots):
    Checkpointer(roots("top"), async_save=False, run_id="member-top", stage="canary", spec=SPEC).save(
        8, _state(8, 3.0), {"mlflow_run_id": "mlflow-of-top"})
    child = load_spec_text(TINY_DIGITS, ["recipe.params.dropout=0.2", "optim.lr=0.06"])
    bottom = {"run_id": "member-bottom", "stage": "canary", "spec": child}
    assert Checkpointer(roots("bottom"), async_save=False, **bottom).init_from(roots("top")) == 8
    ck = Checkpointer(roots("bottom"), async_save=False, **bottom)
    step, state = ck.load_latest()
    assert step == 8 and state["model"]["weight"].eq(_state(8, 3.0)["model"]["weight"]).all()
    manifest = ck.manifest(8)
    assert manifest["run_id"] == "member-bottom" and "mlflow_run_id" not in manifest
    assert manifest["init_from"]["run_id"] == "member-top" and manifest["init_from"]["uri"].startswith(roots("top"))
    with pytest.raises(CheckpointRefused, match="belongs to run 'member-bottom'"):
        Checkpointer(roots("bottom"), async_save=False, run_id="member-top", stage="canary", spec=SPEC).load(8)


def test_init_from_without_an_identity_is_taken_over_by_the_first_run_that_resumes_it(roots):
    Checkpointer(roots("top"), async_save=False, run_id="member-top", stage="canary", spec=SPEC).save(8, _state(8, 3.0))
    assert Checkpointer(roots("bottom"), async_save=False).init_from(roots("top")) == 8
    newcomer = {"run_id": "member-bottom", "stage": "canary", "spec": load_spec_text(TINY_DIGITS, ["optim.lr=0.01"])}
    ck = Checkpointer(roots("bottom"), async_save=False, **newcomer)
    assert ck.load_latest()[0] == 8
    ck.save(9, _state(9, 3.0))
    assert ck.manifest(9)["run_id"] == "member-bottom"


def test_init_from_refuses_a_tampered_source_and_copies_nothing(roots):
    src = Checkpointer(roots("top"), async_save=False, run_id="member-top", stage="canary", spec=SPEC)
    src.save(8, _state(8, 3.0))
    _forge_manifest(src.uri, 9, {"../elsewhere.pt": _entry(b"x")})
    with pytest.raises(CheckpointRefused, match="not a plain file"):
        Checkpointer(roots("bottom"), async_save=False).init_from(roots("top"))
    assert Checkpointer(roots("bottom"), async_save=False).list_steps() == []


# ---------------------------------------------------------------------------------------- through the runtime
def test_a_training_process_that_finds_a_crossed_checkpoint_exits_64_naming_the_reason(tmp_path):
    spec_path = write_spec(tmp_path / "spec.yaml", "digits", 8, "checkpoint: {every_steps: 4}\n")
    drill = Drill("crossed", spec_path, 1, tmp_path, env=dict(os.environ))
    # Another run's checkpoint where this run looks for its own (a mistyped or reused checkpoint.uri).
    Checkpointer(drill.checkpoint_uri, async_save=False, run_id="someone-else", stage="full",
                 spec=load_spec(spec_path)).save(4, _state(4, 1.0))
    rc = drill._wait(drill._launch())
    assert rc == exitcodes.USER_ERROR, drill._stderr()[-3000:]
    words = json.loads((drill.out / "last_words.rank0.json").read_text())
    assert words["error"].startswith("CheckpointRefused: checkpoint ")
    assert "it belongs to run 'someone-else', not to this run 'crossed'" in words["error"]
    assert "\n" not in words["error"]
    assert not (drill.out / "result.json").exists()
