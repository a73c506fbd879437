"""MLflow's own columns on traingate's runs, checked on a real SQLite store without a ladder: the standard
tags, the data snapshot as a dataset input of the training stages, and a pipeline run's headline metrics."""
from __future__ import annotations

import json

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from tgtest import TINY_DIGITS
from tracking_helpers import fresh_store
from traingate.spec import load_spec
from traingate.tracking import runs
from traingate.tracking.standard import dataset_fields, run_link, standard_tags

SNAPSHOT = "dir-" + "ab" * 32
IDENTITY = {"code": {"sha": "1" * 40, "dirty": "false", "source": "git"}, "data_snapshot": SNAPSHOT,
            "data_uri": "s3://corpora/digits/v7/", "environment": {"python": "3.11"}}


def _spec(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(TINY_DIGITS)
    return load_spec(path)


def test_pipeline_and_stage_runs_carry_mlflows_standard_tags_and_training_stages_their_dataset(tmp_path):
    c = MlflowClient(fresh_store(tmp_path / "mlflow.db"))
    spec = _spec(tmp_path)
    parent = runs.open_pipeline_run(c, spec, (tmp_path / "art").as_uri(), IDENTITY, request_key="p-1")
    unit = runs.open_stage_run(c, parent, "unit", request_key="s-unit")
    canary = runs.open_stage_run(c, parent, "canary", request_key="s-canary")
    runs.open_stage_run(c, parent, "canary", request_key="s-canary")  # a retried open: the input is not doubled

    p = c.get_run(parent)
    assert {k: v for k, v in p.data.tags.items() if k.startswith("mlflow.") and k != "mlflow.note.content"} == {
        "mlflow.source.name": "traingate recipe digits-cnn",
        "mlflow.source.type": "JOB",
        "mlflow.source.git.commit": "1" * 40,
        "mlflow.user": "tester",
        "mlflow.runName": p.info.run_name,
    }
    for rid in (unit, canary):
        t = c.get_run(rid).data.tags
        assert t["mlflow.runName"] == c.get_run(rid).info.run_name == f"{p.info.run_name}/{t['traingate.stage']}"
        assert t["mlflow.source.git.commit"] == "1" * 40 and t["mlflow.user"] == "tester"
        assert t["mlflow.source.type"] == "JOB" and t["traingate.identity_valid"] == "true"

    assert c.get_run(unit).inputs.dataset_inputs == []  # the unit stage runs tests, it trains on nothing
    inputs = c.get_run(canary).inputs.dataset_inputs
    assert len(inputs) == 1
    d = inputs[0].dataset
    assert (d.name, d.digest, d.source_type) == ("v7", SNAPSHOT[:36], "s3")
    assert json.loads(d.source) == {"uri": "s3://corpora/digits/v7/"}
    assert json.loads(d.profile) == {"snapshot": SNAPSHOT}
    assert {(t.key, t.value) for t in inputs[0].tags} == {("mlflow.data.context", "training")}


def test_closing_a_pipeline_run_logs_headline_metrics_from_the_furthest_stage(tmp_path):
    c = MlflowClient(fresh_store(tmp_path / "mlflow.db"))
    parent = runs.open_pipeline_run(c, _spec(tmp_path), (tmp_path / "art").as_uri(), IDENTITY, request_key="p-1")
    measured = {
        "smoke": {"stage.cost_usd": 0.01, "stage.val_loss": 2.1, "stage.step_time_mean_s": 0.5},
        "canary": {"stage.cost_usd": 0.02, "stage.val_loss": 1.2, "stage.samples_per_s": 300.0,
                   "stage.step_time_mean_s": 0.2},
        "full": {"stage.cost_usd": 0.04, "stage.val_loss": 0.7, "stage.samples_per_s": 800.0,
                 "stage.step_time_mean_s": 0.08},
    }
    for stage, metrics in measured.items():
        rid = runs.open_stage_run(c, parent, stage, request_key=f"s-{stage}")
        c.log_batch(rid, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
    runs.close_pipeline_run(c, parent, True, "full")

    m = c.get_run(parent).data.metrics
    assert m["val_loss"] == 0.7 and m["samples_per_s"] == 800.0 and m["steps_per_s"] == 1 / 0.08
    assert m["cost_usd"] == m["pipeline.cost_usd"] == sum(s["stage.cost_usd"] for s in measured.values())


def test_a_run_without_declared_data_has_no_dataset_and_a_content_hash_is_no_commit(tmp_path):
    assert dataset_fields("undeclared", "undeclared") is None
    spec = _spec(tmp_path)
    tags = standard_tags(spec, {"sha": "sha256:" + "0" * 64, "dirty": "false", "source": "content"}, "r")
    assert "mlflow.source.git.commit" not in tags and tags["mlflow.source.name"] == "traingate recipe digits-cnn"


def test_a_run_link_leads_to_the_tracking_servers_ui_without_its_credentials():
    assert run_link("http://svc:s3cret@mlflow.internal:5000", "ab12") == (
        "MLflow run: [ab12](http://mlflow.internal:5000/#/runs/ab12)"
    )
    local = run_link("sqlite:////srv/state/mlflow.db", "ab12")
    assert "`ab12`" in local and "mlflow ui --backend-store-uri sqlite:////srv/state/mlflow.db" in local


def test_a_parent_opened_with_its_tags_only_is_complete_once_filled_before_its_stage_runs_copy_it(tmp_path):
    # The ladder's order: the parent's tags, a stage run created from them, then (beside the first launch) the
    # parent's params and identity artifacts, then the stage run's copy of them.
    c = MlflowClient(fresh_store(tmp_path / "mlflow.db"))
    spec = _spec(tmp_path)
    tags_only = {k: v for k, v in IDENTITY.items() if k != "environment"}
    parent = runs.open_pipeline_run(c, spec, (tmp_path / "art").as_uri(), tags_only, request_key="p-1", validate=False)
    p = c.get_run(parent)
    assert p.data.params == {} and c.list_artifacts(parent) == []
    assert p.data.tags["traingate.run_id"] == parent and p.data.tags["traingate.data_snapshot"] == SNAPSHOT
    smoke = runs.create_stage_run(c, parent, "smoke", request_key="s-smoke")
    assert c.get_run(smoke).data.tags["traingate.code_version"] == "1" * 40  # inherited as it opened

    assert runs.fill_pipeline_run(c, parent, spec, IDENTITY["environment"]) == []  # its identity now complete
    runs.fill_pipeline_run(c, parent, spec, IDENTITY["environment"])  # again: the same values
    runs.fill_stage_run(c, parent, smoke, "smoke")
    p, s = c.get_run(parent), c.get_run(smoke)
    assert s.info.run_name == f"{p.info.run_name}/smoke" and p.info.run_name.endswith(parent[:8])  # renamed as filled
    assert p.data.params and s.data.params == p.data.params
    assert p.data.tags["traingate.identity_valid"] == s.data.tags["traingate.identity_valid"] == "true"
    for folder in ("spec", "identity"):
        stored = {a.path for a in c.list_artifacts(parent, folder)}
        assert stored and stored == {a.path for a in c.list_artifacts(smoke, folder)}
