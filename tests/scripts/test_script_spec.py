"""What a script job is before and around its launch: its arguments, the refusals, its checkpoint set, its
code version. Plain functions on temp dirs; the CLI tests run `traingate validate` and `run --dry-run`
through flows.cli.main in this process."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from traingate.job import envvars
from traingate.job.stagejob import derive
from traingate.job.vocab import Cause
from traingate.launch.command import stage_command
from traingate.recipes import script as script_recipe
from traingate.settings import Settings
from traingate.spec import SpecError, parse_spec
from traingate.tracking.identity import content_version, script_code_version
from traingate.ladder.preflight import check_spec

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "script_project2"


def tree(script: dict, **sections) -> dict:
    return {"identity": {"experiment": "e", "owner": "o", "team": "t", "purpose": "p"},
            "recipe": {"name": "script", "script": {"workdir": str(PROJECT), "command": ["python", "train.py"],
                                                    "metrics": [r'"step": (?P<step>\d+), "loss": (?P<loss>\S+),'],
                                                    **script}},
            "resources": {"procs_per_node": 1}, **sections}


def job_of(spec, tmp_path, **kw):
    return derive(spec, "full", run_id="r1", run_dir=tmp_path / "runs" / "r1",
                  settings=Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path / "state")}), **kw)


def test_platform_locations_are_expanded_in_command_stage_args_and_resume_args_at_launch(tmp_path):
    spec = parse_spec(tree({"command": ["python", "train.py", "--out=${TRAINGATE_CHECKPOINT_DIR}/run-${TRAINGATE_RUN_ID}"],
                            "stage_args": {"full": ["--log", "${TRAINGATE_STAGE_DIR}/own.log"]},
                            "resume_args": ["--resume", "${TRAINGATE_CHECKPOINT_DIR}/last.pt",
                                            "--attempt", "${TRAINGATE_RESTART_COUNT}"]},
                           checkpoint={"uri": "s3://bucket/ck"}))
    check_spec(spec)
    job = job_of(spec, tmp_path)
    local = str(tmp_path / "runs" / "r1" / "full" / "checkpoints")  # s3:// is uploaded to, never written by the script
    assert job.checkpoint_dir == local
    assert stage_command(job, "/py") == ["/py", "train.py", f"--out={local}/run-r1", "--log",
                                         f"{tmp_path}/runs/r1/full/own.log"]
    again = job.next_attempt(Cause.WORKER_LOST, 1.0).launch(2.0, script_resume=True)
    assert stage_command(again, "/py")[-4:] == ["--resume", f"{local}/last.pt", "--attempt", "1"]
    # The script reads the same directory from its environment as from its arguments.
    assert envvars.job_environment(again, base={})["TRAINGATE_CHECKPOINT_DIR"] == local


def test_a_local_checkpoint_uri_is_the_scripts_own_directory(tmp_path):
    spec = parse_spec(tree({}, checkpoint={"uri": (tmp_path / "ck").as_uri()}))
    assert job_of(spec, tmp_path).checkpoint_dir == str(tmp_path / "ck" / "r1" / "full")


def test_a_secret_reference_is_never_expanded_into_the_arguments_by_the_platform_expansion():
    spec = parse_spec(tree({"command": ["python", "train.py", "--token", "${env:API_TOKEN}",
                                        "--dir", "${TRAINGATE_STAGE_DIR}"]}))
    cmd = script_recipe.build_command(spec, "full", "/py", 1, values={envvars.STAGE_DIR: "/s"})
    assert cmd == ["/py", "train.py", "--token", "${env:API_TOKEN}", "--dir", "/s"]
    assert set(envvars.SCRIPT_ARG_VARS) == {"TRAINGATE_RUN_ID", "TRAINGATE_STAGE", "TRAINGATE_STAGE_DIR",
                                            "TRAINGATE_CHECKPOINT_DIR", "TRAINGATE_RESTART_CAUSE",
                                            "TRAINGATE_RESTART_COUNT", "TRAINGATE_JOB"}


def test_an_unknown_traingate_variable_in_an_argument_is_refused_in_one_line_naming_field_value_and_fix():
    spec = parse_spec(tree({"resume_args": ["--resume", "${TRAINGATE_CHEKPOINT_DIR}/last.pt"]}))
    with pytest.raises(SpecError) as e:
        check_spec(spec)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("recipe.script.resume_args[1] = '${TRAINGATE_CHEKPOINT_DIR}/last.pt': "
                          "${TRAINGATE_CHEKPOINT_DIR} is not a location traingate provides; use one of ")
    assert "${TRAINGATE_CHECKPOINT_DIR}" in msg


def test_traingate_validate_exits_2_with_one_line_for_an_unknown_variable(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree({"stage_args": {"canary": ["--out", "${TRAINGATE_OUTPUT}"]}})))
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(tmp_path / "state"))
    code = main(["validate", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "recipe.script.stage_args.canary[1] = '${TRAINGATE_OUTPUT}'" in lines[0], err


def test_needs_cuda_on_a_cpu_pool_is_refused_before_launching_in_one_line():
    with pytest.raises(SpecError) as e:
        check_spec(parse_spec(tree({"needs_cuda": True})))
    assert str(e.value) == ("recipe.script.needs_cuda = true: work pool 'cpu-local' is a CPU pool (gpus_per_node 0) "
                            "and the script would fail there; set resources.work_pool to a GPU pool")
    check_spec(parse_spec(tree({"needs_cuda": True, "launcher": "torchrun"},
                               resources={"work_pool": "gpu-a100", "procs_per_node": 1})))


@pytest.mark.parametrize("glob", ["/abs/*.pt", "../up/*.pt", "${TRAINGATE_CHECKPOINT_DIR}/*.pt"])
def test_a_checkpoint_glob_must_be_relative_to_the_checkpoint_dir(glob):
    with pytest.raises(SpecError, match=r"recipe.script.checkpoints = .*: a glob relative to"):
        check_spec(parse_spec(tree({"checkpoints": glob})))


def test_a_checkpoint_exists_when_the_glob_matches_a_file_or_without_a_glob_when_the_dir_is_not_empty(tmp_path):
    d = tmp_path / "ck"
    assert not script_recipe.has_checkpoint(d, "ckpt_*.pt") and not script_recipe.has_checkpoint(d, None)
    d.mkdir()
    (d / script_recipe.INDEX).write_text("{}")  # traingate's own index is not the script's checkpoint
    (d / "notes.txt").write_text("x")
    assert not script_recipe.has_checkpoint(d, "ckpt_*.pt") and script_recipe.has_checkpoint(d, None)
    (d / "ckpt_000010.pt").write_text("x")
    assert script_recipe.has_checkpoint(d, "ckpt_*.pt")


def test_published_checkpoints_are_indexed_mirrored_and_restored_on_a_host_without_them(tmp_path):
    local, remote, other_host = tmp_path / "local", (tmp_path / "remote").as_uri(), tmp_path / "elsewhere"
    local.mkdir()
    (local / "ckpt_000010.pt").write_bytes(b"a" * 10)
    (local / "sub").mkdir()
    (local / "sub" / "ckpt_000020.pt").write_bytes(b"b" * 20)
    (local / "scratch.tmp").write_bytes(b"not declared")
    entries = script_recipe.publish(local, "**/ckpt_*.pt", remote)
    assert sorted((c.path, c.size, c.step) for c in entries) == [("ckpt_000010.pt", 10, 10),
                                                                ("sub/ckpt_000020.pt", 20, 20)]
    assert script_recipe.read_index(remote) == entries
    (local / "ckpt_000010.pt").unlink()  # the script's own retention
    script_recipe.publish(local, "**/ckpt_*.pt", remote)
    assert not (tmp_path / "remote" / "ckpt_000010.pt").exists() and not (tmp_path / "remote" / "scratch.tmp").exists()
    restored = script_recipe.restore(remote, other_host, "**/ckpt_*.pt")
    assert [c.path for c in restored] == ["sub/ckpt_000020.pt"]
    assert (other_host / "sub" / "ckpt_000020.pt").read_bytes() == b"b" * 20


def test_a_checkpoint_changed_after_it_was_published_is_refused_by_its_sha256(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    local.mkdir()
    (local / "ckpt_000005.pt").write_bytes(b"good")
    [entry] = script_recipe.publish(local, "ckpt_*.pt", remote.as_uri())
    (remote / "ckpt_000005.pt").write_bytes(b"evil")
    with pytest.raises(OSError, match="differs from its index"):
        script_recipe.fetch(remote.as_uri(), entry, tmp_path / "got" / "ckpt_000005.pt")
    assert not (tmp_path / "got" / "ckpt_000005.pt").exists()


def test_a_gitless_project_gets_a_stable_content_hash_that_changes_when_a_file_changes(tmp_path):
    proj = tmp_path / "proj"
    (proj / "pkg" / "__pycache__").mkdir(parents=True)
    (proj / "train.py").write_text("print('train')\n")
    (proj / "pkg" / "model.py").write_text("W = 1\n")
    state = proj / ".tg-state"
    state.mkdir()
    v1 = script_code_version(proj, state)
    assert v1["source"] == "content" and v1["dirty"] == "false" and v1["sha"].startswith("sha256:")
    assert script_code_version(proj, state) == v1  # deterministic
    # What is not the project's code: caches, bytecode, git's store, the state dir inside it.
    (proj / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    (proj / "pkg" / "stale.pyc").write_bytes(b"\0")
    (state / "mlflow.db").write_bytes(b"runs")
    (proj / ".git").mkdir()  # a broken .git (no repository): skipped like a real one's store
    (proj / ".git" / "HEAD").write_text("x")
    assert script_code_version(proj, state)["sha"] == v1["sha"]
    (proj / "pkg" / "model.py").write_text("W = 2\n")
    v2 = script_code_version(proj, state)
    assert v2["sha"] != v1["sha"]
    (proj / "pkg" / "model.py").rename(proj / "pkg" / "model2.py")  # a rename is a change too
    assert content_version(proj, (state,))["sha"] not in (v1["sha"], v2["sha"])


def test_a_script_project_in_git_is_versioned_by_git(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("print(1)\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=proj, check=True)
    subprocess.run([*git, "add", "."], cwd=proj, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=proj, check=True)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=proj, capture_output=True, text=True).stdout.strip()
    assert script_code_version(proj) == {"sha": sha, "dirty": "false", "source": "git", "diff_hash": ""}
    (proj / "train.py").write_text("print(2)\n")
    v = script_code_version(proj)
    assert v["dirty"] == "true" and len(v["diff_hash"]) == 16


def test_the_resumable_script_example_is_a_valid_spec_whose_launch_names_its_checkpoint_dir(tmp_path):
    from traingate.spec import load_spec

    example = Path(__file__).resolve().parents[2] / "examples" / "script_project2"
    spec = load_spec(example / "spec.yaml", [f"data.uri={(example / 'data.csv').as_uri()}"])
    check_spec(spec)
    job = job_of(spec, tmp_path)
    assert stage_command(job, "/py")[:4] == ["/py", "train.py", "--ckpt-dir", job.checkpoint_dir]
    assert spec.recipe.script.workdir == str(example)


def test_the_plan_says_once_which_interpreter_runs_python_and_that_traingate_sets_an_unset_omp_num_threads(
        tmp_path, monkeypatch, capsys):
    from flows.cli import main

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree({})))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(tmp_path / "state"))
    code = main(["run", "--dry-run", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    said = [line for line in out.splitlines() if line.startswith("traingate: ")]
    assert len(said) == 2, out
    assert said[0].startswith(f"traingate: `python` in recipe.script.command runs {sys.executable} "), said
    assert said[1].startswith("traingate: OMP_NUM_THREADS=1 for the stage processes (unset here)"), said


def test_omp_num_threads_the_user_set_reaches_the_script_unchanged_and_traingate_says_nothing_about_it(tmp_path):
    job = job_of(parse_spec(tree({})), tmp_path)
    assert envvars.job_environment(job, base={"OMP_NUM_THREADS": "6"})["OMP_NUM_THREADS"] == "6"
    assert envvars.omp_threads_note({"OMP_NUM_THREADS": "6"}) is None
    assert envvars.job_environment(job, base={})["OMP_NUM_THREADS"] == "1"  # what torchrun gives each worker


def test_a_command_that_names_its_own_interpreter_runs_it_as_written_and_gets_no_interpreter_line(tmp_path):
    spec = parse_spec(tree({"command": ["/opt/py/bin/python3", "train.py"]}))
    assert stage_command(job_of(spec, tmp_path), sys.executable)[0] == "/opt/py/bin/python3"
    assert script_recipe.interpreter_note(spec, sys.executable) is None
    plain = parse_spec(tree({}))
    assert stage_command(job_of(plain, tmp_path), sys.executable)[0] == sys.executable
