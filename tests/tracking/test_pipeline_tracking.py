"""The tracking contract on a real ladder: identity on every run, artifacts, promotion, ranks, secrets, CLI.

One ladder (real Prefect test harness, real torchrun with 2 ranks, MLflow on SQLite, checkpoints
on a real S3 endpoint on loopback) runs once for the module; each test marked slow reads what it left.
The request-key tests check that a retried create never leaves an orphan run or a duplicate
model version, with faults injected around (or inside) a real SQLite store.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tgtest import TINY_DIGITS, free_port
from tracking_helpers import fresh_store

from traingate.promotion.aliases import CANDIDATE
from traingate.promotion.register import register_candidate
from traingate.redact import redact
from traingate.spec import load_spec
from traingate.tracking import runs

ACCESS_KEY = "tgtest-access-key-id-AKIA0001"
SECRET_KEY = "tgtest-secret-key-do-not-leak-0123456789"
URL_PASSWORD = "pw-in-url-9f3kQ7"
SECRETS = (ACCESS_KEY, SECRET_KEY, URL_PASSWORD)
PURPOSE = f"check tracking; warehouse at postgresql://svc:{URL_PASSWORD}@db.internal/warehouse"


@pytest.fixture(scope="module")
def ladder(prefect_harness, tmp_path_factory):
    """Run the whole ladder once, with S3 credentials and a password-bearing URL in play."""
    import boto3
    from moto.server import ThreadedMotoServer

    root = tmp_path_factory.mktemp("ladder")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        port = free_port()
        s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        s3.start()
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="tg-track")
        mp.setenv("TRAINGATE_S3_ENDPOINT_URL", endpoint)
        mp.setenv("TRAINGATE_CHECKPOINT_URI", "s3://tg-track/checkpoints")
        mp.setenv("TRAINGATE_OPTUNA_STORAGE", f"postgresql://optuna:{URL_PASSWORD}@127.0.0.1:1/optuna")
        mp.setenv("TRAINGATE_STATE_DIR", str(root / "state"))
        uri = fresh_store(root / "state" / "mlflow.db")
        spec = root / "spec.yaml"
        spec.write_text(TINY_DIGITS.replace("purpose: exercise the ladder in tests", f"purpose: '{PURPOSE}'"))
        from flows.pipeline import pipeline

        state = pipeline(str(spec), [], "full", return_state=True)
        summary = state.result(raise_on_failure=False)
        try:
            yield {"state": state, "summary": summary, "uri": uri, "spec": spec, "root": root,
                   "client": MlflowClient(uri)}
        finally:
            s3.stop()


def _stages(ladder) -> dict:
    return {r.data.tags["traingate.stage"]: r for r in runs.stage_runs(ladder["client"], ladder["summary"]["run_id"])}


@pytest.mark.slow
def test_ladder_climbs_all_four_stages_and_records_each(ladder):
    from prefect.artifacts import Artifact

    from traingate.ladder.plan import plan
    from traingate.runtime.checkpoint import Checkpointer
    from traingate.settings import Settings
    from traingate.tracking.prior import latest_canary_profile

    assert ladder["state"].is_completed(), ladder["state"].message
    summary = ladder["summary"]
    assert list(summary["stages"]) == ["unit", "smoke", "canary", "full"]
    c: MlflowClient = ladder["client"]
    parent = c.get_run(summary["run_id"])
    assert parent.info.status == "FINISHED" and parent.data.params["optim.lr"] == "0.05"
    stages = _stages(ladder)
    assert set(stages) == {"unit", "smoke", "canary", "full"}
    for name, run in stages.items():
        assert run.data.tags["traingate.gate_passed"] == "true", name
    assert stages["unit"].data.metrics["stage.tests_passed"] >= 7
    assert stages["smoke"].data.metrics["stage.resumed_from_step"] == 2
    canary = stages["canary"].data.metrics
    for k in ("stage.step_time_p50_s", "stage.step_time_p99_s", "stage.samples_per_s", "stage.peak_memory_mb",
              "stage.startup_s", "estimate.next_stage_wall_s", "estimate.next_stage_cost_usd"):
        assert canary[k] > 0, k
    full = stages["full"].data.metrics
    assert full["stage.world_size"] == 2 and full["stage.steps"] == 16
    assert Checkpointer(summary["checkpoint_uri"]).find_latest() == 16  # its manifest in the S3 store

    artifact = Artifact.get(f"tg-{summary['run_id']}-3-canary")
    assert artifact is not None and "step_time_p99_s" in artifact.data

    # The next dry run of this experiment turns cost ceilings into estimates from this canary.
    prior = latest_canary_profile(Settings.from_env(), "tests", "digits-cnn")
    assert prior is not None and prior["step_time_mean_s"] > 0
    rows = plan(load_spec(ladder["spec"]), {}, "full", profile=prior)
    assert rows[3]["est_cost_usd"] > 0 and rows[3]["est_wall_s"] > 16 * prior["step_time_mean_s"]


@pytest.mark.slow
def test_every_pipeline_and_stage_run_carries_the_full_identity(ladder):
    c: MlflowClient = ladder["client"]
    parent_id = ladder["summary"]["run_id"]
    spec = load_spec(ladder["spec"])
    exp = c.get_experiment_by_name("tests")
    found = c.search_runs([exp.experiment_id], f"tags.`traingate.run_id` = '{parent_id}'")
    assert {r.data.tags["traingate.kind"] for r in found} == {"pipeline", "stage"} and len(found) == 5
    for run in found:
        t, p = run.data.tags, run.data.params
        assert run.info.run_name and run.info.experiment_id == exp.experiment_id
        assert t["traingate.experiment"] == "tests" and t["traingate.owner"] == "tester"
        assert t["traingate.team"] == "platform" and t["traingate.purpose"].startswith("check tracking")
        assert re.fullmatch(r"[0-9a-f]{40}", t["traingate.code_version"])
        assert t["traingate.code_dirty"] in ("true", "false")
        assert (t["traingate.code_dirty"] == "true") == bool(t["traingate.code_diff_hash"])
        assert re.fullmatch(r"[0-9a-f]{64}", t["traingate.data_snapshot"]) or len(t["traingate.data_snapshot"]) >= 16
        assert t["traingate.data_uri"] == "sklearn://load_digits"
        assert t["traingate.spec_hash"] == spec.spec_hash()
        assert p == {k: redact(v) for k, v in spec.flat().items()}  # the full resolved spec, every field
        assert p["resources.procs_per_node"] == "2" and p["stages.full.max_steps"] == "16"
        assert t["traingate.identity_valid"] == "true", t.get("traingate.identity_missing")
        env = json.loads(Path(c.download_artifacts(run.info.run_id, runs.ENVIRONMENT_ARTIFACT,
                                                   str(ladder["root"] / "dl" / run.info.run_id))).read_text())
        assert env["python"].startswith("3.11") and env["torch"].startswith("2.")
        assert {"cuda", "cudnn", "hostname", "cpu"} <= set(env) and env["gpus"] == []  # no GPU on this machine
        assert any(pkg.startswith("mlflow==") for pkg in env["packages"])
        resolved = json.loads(Path(c.download_artifacts(run.info.run_id, runs.SPEC_ARTIFACT,
                                                        str(ladder["root"] / "dl" / run.info.run_id))).read_text())
        assert resolved["optim"]["lr"] == spec.optim.lr and resolved["identity"]["purpose"] == redact(PURPOSE)
        if t["traingate.kind"] == "stage":
            assert t["mlflow.parentRunId"] == parent_id and t["traingate.stage"] in ("unit", "smoke", "canary", "full")


@pytest.mark.slow
def test_a_run_missing_part_of_its_identity_is_tagged_invalid_and_cannot_be_promoted(ladder):
    c: MlflowClient = ladder["client"]
    full = _stages(ladder)["full"]
    assert runs.can_promote(c, full.info.run_id) == (True, [])
    # A copy of the full stage's run that lost its purpose and its environment snapshot.
    broken = runs.open_stage_run(c, ladder["summary"]["run_id"], "full", request_key="broken-copy-of-full")
    c.delete_tag(broken, "traingate.purpose")
    for k in ("traingate.stage_status", "traingate.gate_passed"):
        c.set_tag(broken, k, full.data.tags[k])
    problems = runs.validate_identity(c, broken)
    assert problems == ["traingate.purpose"]
    t = c.get_run(broken).data.tags
    assert t["traingate.identity_valid"] == "false" and t["traingate.identity_missing"] == "traingate.purpose"
    ok, reasons = runs.can_promote(c, broken)
    assert not ok and reasons == ["identity incomplete: traingate.purpose"]
    out = register_candidate(c, load_spec(ladder["spec"]), broken, ladder["summary"]["checkpoint_uri"])
    assert out["registered"] is False
    assert c.get_run(broken).data.tags["traingate.promotion"].startswith("refused: identity incomplete")
    c.delete_run(broken)


@pytest.mark.slow
def test_full_stage_model_is_logged_and_registered_with_the_candidate_alias(ladder):
    import mlflow.pytorch
    import torch

    c: MlflowClient = ladder["client"]
    full = _stages(ladder)["full"]
    model = ladder["summary"]["model"]
    assert model["registered"] and model["alias"] == CANDIDATE
    version = c.get_model_version_by_alias(model["name"], CANDIDATE)
    assert version.run_id == full.info.run_id
    assert version.tags["traingate.run_id"] == ladder["summary"]["run_id"]
    net = mlflow.pytorch.load_model(f"models:/{model['name']}@{CANDIDATE}")
    assert net(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def _artifact_files(c: MlflowClient, run_id: str, dest: Path) -> list[Path]:
    local = Path(c.download_artifacts(run_id, "", str(dest)))
    return [p for p in local.rglob("*") if p.is_file()]


@pytest.mark.slow
def test_stage_runs_hold_gate_reports_plots_eval_outputs_and_checkpoint_uris_not_copies(ladder):
    c: MlflowClient = ladder["client"]
    stages = _stages(ladder)
    full = stages["full"].info.run_id
    files = {str(p.relative_to(ladder["root"] / "art" / full)): p
             for p in _artifact_files(c, full, ladder["root"] / "art" / full)}
    # The one PNG a stage writes is what MLflow does not draw: its loss and throughput curves are MLflow's charts.
    assert sorted(f for f in files if f.endswith(".png")) == ["eval/confusion.png"]
    assert files["eval/confusion.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    confusion = json.loads(files["eval/confusion.json"].read_text())
    assert len(confusion) == 10 and sum(map(sum, confusion)) == 180  # the digits validation split
    assert "Gate: passed" in files["gate/report.md"].read_text()
    index = json.loads(files["checkpoints/index.json"].read_text())
    assert index["root"].startswith("s3://tg-track/checkpoints/") and index["steps"]
    assert all(u.startswith("s3://") for u in index["steps"].values())
    assert stages["full"].data.tags["traingate.checkpoint.latest_uri"] == index["steps"]["16"]
    # References, not copies: no checkpoint file is in the artifact store (the model dir is the registered model).
    assert not [f for f in files if f.endswith(".pt") and not f.startswith("model/")]
    for name in ("unit", "smoke", "canary"):
        assert "gate/report.md" in [a.path for a in c.list_artifacts(stages[name].info.run_id, "gate")]


@pytest.mark.slow
def test_rank_zero_logs_every_ranks_system_signals_once_per_logged_step(ladder):
    c: MlflowClient = ladder["client"]
    full = _stages(ladder)["full"]
    expected = list(range(2, 17, 2))  # tiny spec: 16 steps, log_every 2
    assert [m.step for m in c.get_metric_history(full.info.run_id, "train_loss")] == expected
    for rank in (0, 1):
        for signal in ("step_time_s", "cpu_percent", "rss_mb"):
            key = f"system/rank{rank}/{signal}"
            assert [m.step for m in c.get_metric_history(full.info.run_id, key)] == expected, key
    assert "system/rank2/step_time_s" not in full.data.metrics
    assert not [k for k in full.data.metrics if "gpu" in k]  # no GPU here: skipped, not zero
    assert full.data.tags["traingate.sessions"] == "1" and full.data.tags["traingate.restarts"] == "0"
    stage_dir = Path(ladder["summary"]["run_dir"]) / "full"
    assert [p.name for p in (stage_dir / "tracking").iterdir() if p.suffix == ".jsonl"] == ["journal.jsonl"]


@pytest.mark.slow
def test_smoke_stages_planned_stop_and_resume_is_one_run_with_one_restart(ladder):
    smoke = _stages(ladder)["smoke"]
    t = smoke.data.tags
    assert t["traingate.restarts"] == "1" and t["traingate.restart.1.cause"] == "stopped"
    assert t["traingate.restart.1.resumed_from_step"] == "2"
    c: MlflowClient = ladder["client"]
    assert [m.step for m in c.get_metric_history(smoke.info.run_id, "train_loss")] == [2, 4]


@pytest.mark.slow
def test_every_training_stage_forks_its_workers_from_the_runs_one_zygote_which_ends_with_the_run(ladder):
    """Warm restarts are on by default on a CPU pool: the run imports the training stack once, and the smoke
    stage's two halves and both ranks of canary and full are forked from that zygote."""
    import psutil

    run_dir = ladder["root"] / "state" / "runs" / ladder["summary"]["run_id"]
    log = (run_dir / "zygote.log").read_text()
    ready = re.findall(r"zygote: ready on \S+ \(pid (\d+)\)", log)
    assert len(ready) == 1, log
    forks = re.findall(r"zygote: forked worker \d+ \(rank (\d), torchrun restart \S+\) for (\S+)", log)
    by_stage = {(Path(job).parent.name, rank) for rank, job in forks}
    assert {("smoke", "0"), ("canary", "0"), ("canary", "1"), ("full", "0"), ("full", "1")} <= by_stage, log
    assert sum(Path(job).parent.name == "smoke" for _, job in forks) >= 2, log  # the stop and the resume
    assert not [p for p in run_dir.glob("*/zygote.log")]  # no stage started a zygote of its own
    assert not psutil.pid_exists(int(ready[0])), "the run's zygote outlived its run"


@pytest.mark.slow
def test_no_secret_appears_in_params_tags_artifacts_or_logs(ladder, capsys):
    from flows.cli import main

    c: MlflowClient = ladder["client"]
    run_id = ladder["summary"]["run_id"]
    main(["note", run_id, f"moved data to postgresql://svc:{URL_PASSWORD}@db2/x; key {SECRET_KEY}"])
    capsys.readouterr()
    exp = c.get_experiment_by_name("tests")
    everything = c.search_runs([exp.experiment_id])
    assert len(everything) >= 5
    for run in everything:
        texts = [*run.data.params.items(), *run.data.tags.items()]
        for k, v in texts:
            for s in SECRETS:
                assert s not in k and s not in v, (run.info.run_id, k)
        for f in _artifact_files(c, run.info.run_id, ladder["root"] / "scan" / run.info.run_id):
            blob = f.read_bytes()
            for s in SECRETS:
                assert s.encode() not in blob, f
    assert "svc:***@db.internal" in c.get_run(run_id).data.tags["traingate.purpose"]
    logs = [p for p in Path(ladder["summary"]["run_dir"]).rglob("*") if p.is_file() and p.suffix in (".log", ".jsonl")]
    assert logs
    for p in logs:
        for s in SECRETS:
            assert s not in p.read_text(errors="replace"), p


@pytest.mark.slow
def test_note_show_and_runs_commands_read_the_run_back(ladder, capsys):
    from flows.cli import main

    run_id = ladder["summary"]["run_id"]
    assert main(["note", run_id, "lowered the LR: loss spikes after step 2k", "--author", "ana"]) == 0
    capsys.readouterr()
    assert main(["show", run_id]) == 0
    out = capsys.readouterr().out
    assert run_id in out and "tester" in out and "platform" in out and "check tracking" in out
    for stage in ("unit", "smoke", "canary", "full"):
        assert re.search(rf"^  {stage}\s+completed\s+gate passed", out, re.M), stage
    assert "restart " not in out  # the smoke stage's deliberate stop-and-resume is not a restart
    assert "ana: lowered the LR: loss spikes after step 2k" in out
    assert re.search(r"^cost: \$\d+\.\d{4}$", out, re.M)
    assert "promotion: registered" in out and "valid      true" in out

    assert main(["runs", "--experiment", "tests", "--team", "platform", "--sort", "val_accuracy"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["RUN", "ID", "NAME"] and table[0].endswith("VAL_ACCURACY")
    assert any(line.startswith(run_id) and "full" in line for line in table[1:])
    assert main(["runs", "--team", "nobody"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # the header only
    assert main(["show", "0" * 32]) == 2


# ------------------------------------------------------------------ retried creates: one run, one version

class _Flaky:
    """A real MlflowClient whose ``method`` fails once: after doing its work (the reply was lost) or before."""

    def __init__(self, client: MlflowClient, method: str, *, reply_lost: bool = True):
        self.client, self.method, self.reply_lost, self.failed = client, method, reply_lost, 0

    def __getattr__(self, name):
        real = getattr(self.client, name)
        if name != self.method or self.failed:
            return real

        def once(*args, **kwargs):
            self.failed += 1
            if self.reply_lost:
                real(*args, **kwargs)
                raise ConnectionError(f"injected: the reply to {name} was lost")
            raise ConnectionError(f"injected: {name} never reached the store")
        return once


def _spec(tmp_path: Path, experiment: str):
    path = tmp_path / f"{experiment}.yaml"
    path.write_text(TINY_DIGITS.replace("experiment: tests,", f"experiment: {experiment},"))
    return load_spec(path)


IDENTITY = {"code": {"sha": "0" * 40, "dirty": "false"}, "data_snapshot": "d" * 64,
            "data_uri": "sklearn://load_digits", "environment": {"python": "3.11"}}


def _runs_with(c: MlflowClient, spec, **tags: str) -> list:
    exp = c.get_experiment_by_name(spec.identity.experiment)
    where = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    return c.search_runs([exp.experiment_id], where)


def test_opening_a_run_again_with_the_same_request_key_returns_the_same_run(tmp_path):
    c = MlflowClient(fresh_store(tmp_path / "mlflow.db"))
    spec, art = _spec(tmp_path, "keys"), (tmp_path / "art").as_uri()
    parent = runs.open_pipeline_run(c, spec, art, IDENTITY, request_key="pipeline-1")
    assert runs.open_pipeline_run(c, spec, art, IDENTITY, request_key="pipeline-1") == parent
    stage = runs.open_stage_run(c, parent, "canary", request_key="stage-1")
    assert runs.open_stage_run(c, parent, "canary", request_key="stage-1") == stage
    assert [r.info.run_id for r in _runs_with(c, spec, **{"traingate.kind": "pipeline"})] == [parent]
    assert [r.info.run_id for r in runs.stage_runs(c, parent)] == [stage]
    # A new request is a new run; the stage does not inherit its parent's key.
    other = runs.open_stage_run(c, parent, "canary", request_key="stage-2")
    assert other != stage and len(runs.stage_runs(c, parent)) == 2
    assert c.get_run(stage).data.tags[runs.REQUEST_KEY_TAG] == "stage-1"


def test_a_create_whose_reply_was_lost_is_retried_into_the_run_it_created(tmp_path):
    c = MlflowClient(fresh_store(tmp_path / "mlflow.db"))
    spec, art = _spec(tmp_path, "lost-replies"), (tmp_path / "art").as_uri()
    flaky = _Flaky(c, "create_run")
    with pytest.raises(ConnectionError, match="reply to create_run was lost"):
        runs.open_pipeline_run(flaky, spec, art, IDENTITY, request_key="pipeline-1")
    assert len(_runs_with(c, spec, **{"traingate.kind": "pipeline"})) == 1  # created, then the reply was lost
    parent = runs.open_pipeline_run(flaky, spec, art, IDENTITY, request_key="pipeline-1")
    assert [r.info.run_id for r in _runs_with(c, spec, **{"traingate.kind": "pipeline"})] == [parent]
    assert runs.identity_problems(c, c.get_run(parent)) == []  # the retry finished what the first attempt began

    flaky = _Flaky(c, "create_run")
    with pytest.raises(ConnectionError):
        runs.open_stage_run(flaky, parent, "full", request_key="stage-1")
    stage = runs.open_stage_run(flaky, parent, "full", request_key="stage-1")
    assert [r.info.run_id for r in runs.stage_runs(c, parent)] == [stage]
    assert c.get_run(stage).data.tags["traingate.identity_valid"] == "true"


def test_a_request_key_reused_for_a_different_run_is_refused(tmp_path):
    c = MlflowClient(fresh_store(tmp_path / "mlflow.db"))
    spec, art = _spec(tmp_path, "reused-keys"), (tmp_path / "art").as_uri()
    parent = runs.open_pipeline_run(c, spec, art, IDENTITY, request_key="pipeline-1")
    runs.open_stage_run(c, parent, "smoke", request_key="stage-1")
    with pytest.raises(ValueError, match="request_key = 'stage-1' already names run"):
        runs.open_stage_run(c, parent, "canary", request_key="stage-1")
    with pytest.raises(ValueError, match="request_key = \"it's\""):
        runs.open_stage_run(c, parent, "canary", request_key="it's")
    assert len(runs.stage_runs(c, parent)) == 1


def test_the_open_stage_run_task_retried_after_a_lost_reply_leaves_one_stage_run(prefect_harness, tmp_path,
                                                                                 monkeypatch):
    from tasks.tracking import open_stage_run

    uri = fresh_store(tmp_path / "mlflow.db")
    monkeypatch.setenv("TRAINGATE_TRACKING_URI", uri)
    c = MlflowClient(uri)
    parent = runs.open_pipeline_run(c, _spec(tmp_path, "task-retries"), (tmp_path / "art").as_uri(), IDENTITY,
                                    request_key="pipeline-1")
    flaky = _Flaky(c, "create_run")
    monkeypatch.setattr(runs, "client", lambda _uri: flaky)
    stage = open_stage_run(parent, "canary")  # the real task: Prefect retries it after 1 s
    assert flaky.failed == 1
    assert [r.info.run_id for r in runs.stage_runs(c, parent)] == [stage]
    assert c.get_run(stage).data.tags[runs.REQUEST_KEY_TAG].startswith("stage-canary-")


def _promotable_full_run(ladder, tmp_path: Path, key: str):
    """A completed, gate-passed full stage run with a complete identity, in its own experiment and model."""
    from mlflow.entities import Metric, RunTag

    from traingate.settings import Settings

    c: MlflowClient = ladder["client"]
    spec = _spec(tmp_path, f"retries-{key}")  # its own model name: the alias is compared per model
    parent = runs.open_pipeline_run(c, spec, Settings.from_env().artifact_uri, IDENTITY, request_key=f"{key}-pipeline")
    stage = runs.open_stage_run(c, parent, "full", request_key=f"{key}-full")
    c.log_batch(stage, metrics=[Metric("stage.val_loss", 0.5, 0, 0)],
                tags=[RunTag("traingate.stage_status", "completed"), RunTag("traingate.gate_passed", "true")])
    assert runs.can_promote(c, stage) == (True, [])
    return c, spec, stage


def _logged_models(c: MlflowClient, run_id: str) -> list:
    return c.search_logged_models([c.get_run(run_id).info.experiment_id], filter_string=f"source_run_id = '{run_id}'")


def _versions(c: MlflowClient, run_id: str) -> list[str]:
    return [str(v.version) for v in c.search_model_versions(f"run_id = '{run_id}'")]  # str or int by call


@pytest.mark.slow
def test_registering_a_full_stage_again_keeps_its_one_model_version(ladder, tmp_path):
    c, spec, stage = _promotable_full_run(ladder, tmp_path, "twice")
    first = register_candidate(c, spec, stage, ladder["summary"]["checkpoint_uri"])
    again = register_candidate(c, spec, stage, ladder["summary"]["checkpoint_uri"])
    assert first["registered"] and str(again["version"]) == str(first["version"])
    assert _versions(c, stage) == [str(first["version"])]
    assert len(_logged_models(c, stage)) == 1
    assert c.get_model_version_by_alias(first["name"], CANDIDATE).run_id == stage
    assert again["registered"], f"a repeated call for the alias holder reports it as not promoted: {again}"


@pytest.mark.slow
def test_a_registration_that_failed_after_logging_the_model_registers_that_model_on_retry(ladder, tmp_path):
    import sqlite3

    from mlflow.exceptions import MlflowException

    c, spec, stage = _promotable_full_run(ladder, tmp_path, "registry-down")
    db = ladder["uri"].removeprefix("sqlite:///")
    with sqlite3.connect(db) as con:  # the registry refuses new versions: a fault inside the real store
        con.execute("CREATE TRIGGER registry_down BEFORE INSERT ON model_versions "
                    "BEGIN SELECT RAISE(ABORT, 'injected: registry down'); END")
    try:
        with pytest.raises(MlflowException, match="Model Version creation error"):
            register_candidate(c, spec, stage, ladder["summary"]["checkpoint_uri"])
    finally:
        with sqlite3.connect(db) as con:
            con.execute("DROP TRIGGER IF EXISTS registry_down")
    [logged] = _logged_models(c, stage)
    assert _versions(c, stage) == []
    out = register_candidate(c, spec, stage, ladder["summary"]["checkpoint_uri"])
    assert out["registered"]
    assert [m.model_id for m in _logged_models(c, stage)] == [logged.model_id]  # not logged a second time
    assert _versions(c, stage) == [str(out["version"])]
    assert c.get_model_version(out["name"], out["version"]).source == f"models:/{logged.model_id}"


@pytest.mark.slow
def test_a_registration_that_failed_before_moving_the_alias_is_retried_into_the_same_version(ladder, tmp_path):
    c, spec, stage = _promotable_full_run(ladder, tmp_path, "alias-fails")
    flaky = _Flaky(c, "set_registered_model_alias", reply_lost=False)
    with pytest.raises(ConnectionError, match="never reached the store"):
        register_candidate(flaky, spec, stage, ladder["summary"]["checkpoint_uri"])
    [created] = _versions(c, stage)
    out = register_candidate(flaky, spec, stage, ladder["summary"]["checkpoint_uri"])
    assert out["registered"] and str(out["version"]) == created
    assert _versions(c, stage) == [created]
    assert c.get_model_version_by_alias(out["name"], CANDIDATE).run_id == stage


@pytest.mark.slow
def test_mlflows_columns_are_filled_and_the_prefect_ui_links_each_stage_to_its_run_with_its_progress(ladder):
    from prefect.artifacts import Artifact

    from traingate.tracking.standard import run_link

    c: MlflowClient = ladder["client"]
    rid = ladder["summary"]["run_id"]
    parent, stages = c.get_run(rid), _stages(ladder)
    t = parent.data.tags
    assert t["mlflow.source.name"] == "traingate recipe digits-cnn" and t["mlflow.source.type"] == "JOB"
    assert t["mlflow.source.git.commit"] == t["traingate.code_version"] and t["mlflow.user"] == "tester"
    assert t["mlflow.runName"] == parent.info.run_name
    for name, run in stages.items():
        assert run.data.tags["mlflow.source.git.commit"] == t["traingate.code_version"], name
        assert run.data.tags["mlflow.runName"] == f"{parent.info.run_name}/{name}"
        inputs = run.inputs.dataset_inputs
        if name == "unit":
            assert inputs == [], "the unit stage trains on nothing"
            continue
        [d] = [i.dataset for i in inputs]
        assert (d.name, d.digest) == ("load_digits", t["traingate.data_snapshot"][:36])
        assert json.loads(d.source) == {"uri": "sklearn://load_digits"}

    # Headline metrics: the final stage's evaluation and throughput, and the run's one cost total.
    m, full = parent.data.metrics, stages["full"].data.metrics
    assert m["val_loss"] == full["stage.val_loss"] and m["samples_per_s"] == full["stage.samples_per_s"] > 0
    assert m["steps_per_s"] == 1 / full["stage.step_time_mean_s"]
    assert m["cost_usd"] == m["pipeline.cost_usd"] == sum(r.data.metrics["stage.cost_usd"] for r in stages.values())

    for n, name in enumerate(("smoke", "canary", "full"), 2):
        link = run_link(ladder["uri"], stages[name].info.run_id)
        report = Artifact.get(f"tg-{rid}-{n}-{name}")
        assert report is not None and link in report.data, name
        progress = Artifact.get(f"tg-{rid}-{n}-{name}-progress")
        assert progress is not None and link in progress.description, name
    full_progress = Artifact.get(f"tg-{rid}-4-full-progress")
    assert float(full_progress.data) == 100.0 and "**full** completed: step 16/16 (100%)" in full_progress.description
