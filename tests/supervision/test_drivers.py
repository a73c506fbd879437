"""The supervisor's shape: what differs between a built-in recipe and a user's script sits behind one
interface (traingate.supervision.drivers), chosen once per job; the loop reads as a short sequence."""
from __future__ import annotations

import ast
import os
import time
from pathlib import Path

from tgtest import ROOT
from traingate.job.stagejob import derive
from traingate.settings import Settings
from traingate.spec import load_spec, parse_spec
from traingate.supervision import drivers
from traingate.supervision.attempts import Hooks

SUPERVISION = ROOT / "traingate" / "supervision"
# What says a job is a script, or what only a script job has: only the drivers may read it.
KIND_ATTRIBUTES = {"is_script", "writes_heartbeats", "script", "script_resume"}


def _kind_reads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES:
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == "script" for c in [node.left, *node.comparators]):
            found.append(f"{path.name}:{node.lineno}: compares with 'script'")
    return found


def test_only_the_recipe_drivers_ask_whether_a_job_is_a_script():
    assert _kind_reads(SUPERVISION / "drivers.py"), "the scan finds the drivers' own reads"
    others = sorted(p for p in SUPERVISION.glob("*.py") if p.name != "drivers.py")
    assert [r for p in others for r in _kind_reads(p)] == []


def test_the_supervise_loop_is_a_short_sequence_of_named_steps():
    tree = ast.parse((SUPERVISION / "supervisor.py").read_text())
    loop = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_supervise")
    assert loop.end_lineno is not None and loop.end_lineno - loop.lineno + 1 <= 20
    steps = {n.func.attr for n in ast.walk(loop) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert {"launch", "wait", "close", "judge", "ended", "restart"} <= steps


def test_no_supervision_module_is_over_400_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in SUPERVISION.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def _script_job(tmp_path: Path, **script: object):
    tree = {
        "identity": {"experiment": "scripts", "owner": "tester", "team": "platform", "purpose": "a script"},
        "recipe": {"name": "script", "script": {"workdir": str(tmp_path), "command": ["python", "train.py"], **script}},
        "resources": {"work_pool": "cpu-local", "procs_per_node": 1},
    }
    return derive(parse_spec(tree), "full", run_id="s", run_dir=tmp_path / "s", settings=Settings.from_env())


def test_a_job_gets_the_driver_of_its_recipe_kind(tiny_spec, tmp_path, state_dir):
    builtin = derive(load_spec(tiny_spec()), "full", run_id="r", run_dir=tmp_path / "r", settings=Settings.from_env())
    script = _script_job(tmp_path)

    b, s = drivers.driver_for(builtin), drivers.driver_for(script)
    assert isinstance(b, drivers.BuiltinDriver) and isinstance(s, drivers.ScriptDriver)
    # A recipe's ranks report by heartbeats and result.json; a script's output is all there is.
    assert b.ranks(builtin) == builtin.world_size == 2 and s.ranks(script) is None
    assert b.cold_start_reason(builtin) is None and "script" in (s.cold_start_reason(script) or "")
    assert b.workdir(builtin) == builtin.stage_dir and s.workdir(script) == str(tmp_path)
    # No checkpoint yet: both start from scratch, and the step is known.
    assert b.resume_point(builtin) == (None, False) and s.resume_point(script) == (None, False)


def test_a_script_resumes_from_its_newest_declared_checkpoint_and_a_nameless_one_is_an_unknown_step(
        tmp_path, state_dir):
    job = _script_job(tmp_path, resume_args=["--resume"], checkpoints="*.pt")
    driver, said = drivers.ScriptDriver(), []
    hooks = Hooks(info=said.append)
    first = driver.launch(job, 1.0, 3, hooks)
    assert first.script_resume is False and first.inplace_restarts == 0 and first.launched_at == 1.0
    assert driver.resume_point(first) == (None, False) and driver.restart_point(first) == (None, False)

    (Path(job.checkpoint_dir) / "ckpt_000040.pt").write_bytes(b"weights")
    again = driver.launch(job.next_attempt("worker_lost", 2.0), 3.0, 2, hooks)
    assert again.script_resume is True
    assert driver.resume_point(again) == (40, False) and driver.restart_point(again) == (40, False)

    newer = Path(job.checkpoint_dir) / "last.pt"  # the newest file, and its name holds no step
    newer.write_bytes(b"weights")
    os.utime(newer, (time.time() + 5, time.time() + 5))
    assert driver.resume_point(again) == (None, True) and driver.restart_point(again) == (None, True)


def test_a_script_without_resume_args_starts_over_and_says_its_checkpoints_may_be_overwritten(tmp_path, state_dir):
    job = _script_job(tmp_path, checkpoints="*.pt")
    Path(job.checkpoint_dir).mkdir(parents=True)
    (Path(job.checkpoint_dir) / "ckpt_000040.pt").write_bytes(b"weights")
    said: list[str] = []
    launched = drivers.ScriptDriver().launch(job, 1.0, 3, Hooks(info=said.append))
    assert launched.script_resume is False
    assert drivers.ScriptDriver().restart_point(launched) == (None, False)
    assert any("resume_args is empty: it starts over and may overwrite them" in line for line in said), said
