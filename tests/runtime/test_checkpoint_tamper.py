"""Tampered or crossed checkpoints are refused, on file:// and on s3:// (a real S3 endpoint on loopback).

Each case runs on both backends, except those about symbolic links, which exist only on a
file system: their ids say ``file-only-symlinks``. The last test goes through a real
``python -m traingate.runtime.train`` process.
"""
from __future__ import annotations

import hashlib
import io
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


# ---------------------------------------------------------------------------------------- signed manifests
KEY = b"0123456789abcdef" * 4  # a deployment's checkpoint key (traingate.settings.checkpoint_key)


def _rewrite_manifest(uri: str, step: int, edit) -> None:
    st = Storage(uri)
    manifest = json.loads(st.read_bytes(f"{step_dir(step)}/{MANIFEST}"))
    edit(manifest)
    st.write_bytes(f"{step_dir(step)}/{MANIFEST}", json.dumps(manifest).encode())


def test_zeroed_weights_with_their_checksum_recomputed_are_refused_by_the_signature_with_no_fallback(roots):
    ck = Checkpointer(roots("ck"), async_save=False, key=KEY, **MINE)
    ck.save(4, _state(4, 1.0))
    ck.save(8, _state(8, 1.0))
    st = Storage(ck.uri)
    zeroed = _state(8, 0.0)["model"]
    buf = io.BytesIO()
    torch.save(zeroed, buf)
    st.write_bytes(f"{step_dir(8)}/model.pt", buf.getvalue())
    _rewrite_manifest(ck.uri, 8, lambda m: m["files"].update({"model.pt": _entry(buf.getvalue())}))
    with pytest.raises(CheckpointRefused) as e:
        Checkpointer(roots("ck"), async_save=False, key=KEY, **MINE).load_latest()
    assert _one_line(e).startswith(f"checkpoint {roots('ck')}/{step_dir(8)} refused: its manifest's signature "
                                   "does not match this deployment's checkpoint key")
    # The same bytes are accepted by a reader without the key: the signature is what refuses them.
    assert Checkpointer(roots("ck"), async_save=False, **MINE).load_latest()[0] == 8


def test_a_foreign_runs_checkpoint_restamped_with_this_runs_identity_is_refused(roots):
    mine = Checkpointer(roots("mine"), async_save=False, key=KEY, **MINE)
    mine.save(4, _state(4, 1.0))
    victim = Checkpointer(roots("victim"), async_save=False, key=KEY, run_id="run-victim", stage="full", spec=SPEC)
    victim.save(8, _state(8, 7.0))
    src, dst = Storage(victim.uri), Storage(mine.uri)
    for name in src.listdir(step_dir(8)):
        dst.write_bytes(f"{step_dir(8)}/{name}", src.read_bytes(f"{step_dir(8)}/{name}"))
    stamp = json.loads(dst.read_bytes(f"{step_dir(4)}/{MANIFEST}"))
    _rewrite_manifest(mine.uri, 8, lambda m: m.update({k: stamp[k] for k in ("run_id", "stage", "fingerprint")}))
    with pytest.raises(CheckpointRefused) as e:
        mine.load_latest()
    assert f"{step_dir(8)} refused: its manifest's signature does not match" in _one_line(e)


def test_an_unsigned_manifest_is_refused_by_a_reader_with_the_key_and_read_by_tools_without_it(roots):
    Checkpointer(roots("ck"), async_save=False, **MINE).save(4, _state(4, 1.0))
    with pytest.raises(CheckpointRefused, match="its manifest carries no signature"):
        Checkpointer(roots("ck"), async_save=False, key=KEY, **MINE).load_latest()
    Checkpointer(roots("ck2"), async_save=False, key=KEY, **MINE).save(4, _state(4, 1.0))
    with pytest.raises(CheckpointRefused, match="signature does not match"):  # another deployment's key
        Checkpointer(roots("ck2"), async_save=False, key=b"another-deployment-key-32-bytes!!", **MINE).load(4)
    assert Checkpointer(roots("ck"), async_save=False).load_latest()[0] == 4


@pytest.mark.parametrize("damage", ["truncated-file", "truncated-manifest"])
def test_a_damaged_newest_checkpoint_is_passed_over_only_after_telling_which_file_and_why(roots, damage):
    told: list[tuple[str, str]] = []
    ck = Checkpointer(roots("ck"), async_save=False, key=KEY, on_fallback=lambda f, why: told.append((f, why)),
                      **MINE)
    ck.save(4, _state(4, 1.0))
    ck.save(8, _state(8, 1.0))
    st = Storage(ck.uri)
    name = "model.pt" if damage == "truncated-file" else MANIFEST
    st.write_bytes(f"{step_dir(8)}/{name}", st.read_bytes(f"{step_dir(8)}/{name}")[:40])
    assert ck.load_latest()[0] == 4
    assert len(told) == 1 and told[0][0] == f"{roots('ck')}/{step_dir(8)}"
    assert told[0][1] == (f"{step_dir(8)}/model.pt fails its sha256 check (corrupt or tampered); it is not loaded"
                          if damage == "truncated-file" else
                          f"{step_dir(8)}/{MANIFEST} is unreadable (truncated, or not the manifest of {step_dir(8)})")


def test_init_from_re_signs_the_copy_and_refuses_a_source_this_key_did_not_sign(roots):
    Checkpointer(roots("top"), async_save=False, key=KEY, run_id="member-top", stage="canary",
                 spec=SPEC).save(8, _state(8, 3.0))
    bottom = {"run_id": "member-bottom", "stage": "canary", "spec": SPEC}
    assert Checkpointer(roots("bottom"), async_save=False, key=KEY, **bottom).init_from(roots("top")) == 8
    assert Checkpointer(roots("bottom"), async_save=False, key=KEY, **bottom).load_latest()[0] == 8
    Checkpointer(roots("unsigned"), async_save=False).save(8, _state(8, 3.0))
    with pytest.raises(CheckpointRefused, match="carries no signature"):
        Checkpointer(roots("other"), async_save=False, key=KEY, **bottom).init_from(roots("unsigned"))


@pytest.mark.slow  # two launches of a training process (~40 s on a loaded 2-core box)
def test_a_training_process_resuming_past_a_truncated_checkpoint_raises_an_alert_and_a_restart_entry(tmp_path):
    from traingate.job import files

    spec_path = write_spec(tmp_path / "spec.yaml", "digits", 8, "checkpoint: {every_steps: 4}\n")
    drill = Drill("fallback", spec_path, 1, tmp_path, env=dict(os.environ))
    assert drill._wait(drill._launch()) == 0, drill._stderr()[-3000:]
    newest = _local(drill.checkpoint_uri) / step_dir(8) / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    assert drill._wait(drill._launch()) == 0, drill._stderr()[-3000:]
    alert = next(a for a in files.read_alerts(drill.out) if a.rule == "checkpoint-fallback")
    assert alert.message.startswith(f"checkpoint {drill.checkpoint_uri}/{step_dir(8)} passed over: "
                                    f"{step_dir(8)}/model.pt fails its sha256 check")
    entry = next(e for e in files.read_logbook(drill.out.parent) if e.kind == "restart")
    assert entry.data == {"file": f"{drill.checkpoint_uri}/{step_dir(8)}",
                          "reason": f"{step_dir(8)}/model.pt fails its sha256 check (corrupt or tampered); "
                                    "it is not loaded"}


def test_promotion_refuses_to_register_weights_changed_after_training(tmp_path):
    from traingate.promotion.torch_model import final_model
    from traingate.recipes import get_recipe
    from traingate.settings import Settings, checkpoint_key

    uri = (tmp_path / "ck").as_uri()
    model = get_recipe(SPEC).build_model()
    Checkpointer(uri, async_save=False, key=checkpoint_key(Settings.from_env()), **MINE).save(
        4, {"model": model.state_dict()})
    assert final_model(SPEC, uri)[0] is not None  # signed by this deployment: registered
    zeroed = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(zeroed, buf)
    Storage(uri).write_bytes(f"{step_dir(4)}/model.pt", buf.getvalue())
    _rewrite_manifest(uri, 4, lambda m: m["files"].update({"model.pt": _entry(buf.getvalue())}))
    with pytest.raises(CheckpointRefused, match="signature does not match this deployment's checkpoint key"):
        final_model(SPEC, uri)
