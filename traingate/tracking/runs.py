"""The ladder's MLflow records: one parent run per pipeline, one child run per stage.

Only the orchestrator creates and closes runs; training processes write into the
stage run they are handed (MLFLOW_RUN_ID). Each run carries the full identity
(:func:`identity_problems` says what is missing); a run without it is tagged
``traingate.identity_valid=false`` and :func:`can_promote` refuses it.

Creating a run is idempotent per request key (:func:`create_run_once`): the tasks that call
these functions are retried, and a retry must find the run its first attempt created rather
than leave it behind as an orphan beside a second one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import mlflow.store.db.utils
import mlflow.tracking
import requests
import sqlalchemy.exc
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repo import ArtifactRepository
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient

from traingate.job.catalog import CheckpointCatalog, step_dir
from traingate.job.result import GateDecision, StageResult, render_markdown
from traingate.redact import redact, redact_mapping
from traingate.settings import SERVER_ARTIFACTS, Settings, export_s3_endpoint
from traingate.spec import STAGES, RunSpec
from traingate.storage import join
from traingate.tracking import compat_mlflow, plots, standard
from traingate.tracking import restarts as restart_record
from traingate.tracking.identity import REQUIRED_TAGS
from traingate.tracking.prior import newest_completed_canary
from traingate.tracking.restarts import is_restart

_MAX_PARAM = 6000  # MLflow's param value limit
SPEC_ARTIFACT = "spec/resolved_spec.json"
ENVIRONMENT_ARTIFACT = "identity/environment.json"
NOTE_PREFIX = "traingate.note."
REQUEST_KEY_TAG = "traingate.request_key"
_REQUEST_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,200}")  # it is quoted into a search filter


def client(tracking_uri: str) -> MlflowClient:
    export_s3_endpoint()  # before MLflow's S3 client exists, and for the training processes started later
    if tracking_uri.startswith("sqlite:///") and tracking_uri not in _WAL:
        _write_ahead_log(Path(tracking_uri.removeprefix("sqlite:///")))
        _WAL.add(tracking_uri)
    return MlflowClient(tracking_uri)


_WAL: set[str] = set()


def warm_mlflow() -> None:
    """For a process that forks commands or flow runs (the engines' preload): what opening any MLflow SQL store
    in this interpreter computes the same way, computed once (:func:`compat_mlflow.cache_schema_head`), and the
    state directory's own SQLite store kept open (:func:`keep_store_open`). A forked child opens other stores on
    its own, checking their databases."""
    compat_mlflow.cache_schema_head(mlflow.store.db.utils)
    keep_store_open(Settings.from_env().tracking_uri)


def keep_store_open(tracking_uri: str) -> None:
    """Open the SQLite tracking store at ``tracking_uri`` (and its model registry) in this forking process, with
    the statements a command reads with compiled, so that each forked child starts with them.

    A child's first MLflow call otherwise opens both stores (their tables and schema revision checked) and
    compiles each statement the first time it runs, about 0.1 CPU-s of a command that forks in under a second.
    The stores' connections are closed before any fork and a child never uses its parent's (each makes its own);
    a child whose database file is no longer the one opened here (removed, or replaced by another file) forgets
    the kept stores and opens the new database as a fresh process would. Nothing is kept for a store that is not
    a SQLite file, or whose file does not exist yet (it is made by the first command that writes).
    """
    if not tracking_uri.startswith("sqlite:///") or tracking_uri in _KEPT:
        return
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    opened = _file_identity(db)
    if opened is None:
        return
    c = client(tracking_uri)
    # Reads of the shapes a command makes (a statement is compiled once per shape): the plan's prior, a stage's
    # runs, a run, a model's versions.
    c.get_experiment_by_name("Default")
    newest_completed_canary(c, "0", "none")
    stage_runs(c, "0" * 32, experiment_id="0")
    with contextlib.suppress(MlflowException):
        c.get_run("0" * 32)
    c.search_model_versions("name = 'none' and run_id = 'none'")
    engines = compat_mlflow.sql_engines(c)
    for engine in engines:
        engine.dispose()  # no connection of this process crosses a fork
    if not _KEPT:
        os.register_at_fork(after_in_child=_after_fork)
    _KEPT[tracking_uri] = (opened, engines)


_KEPT: dict[str, tuple[tuple[int, int], list[Any]]] = {}  # kept store -> (its file's identity, its SQL engines)


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _after_fork() -> None:
    for uri, (opened, engines) in list(_KEPT.items()):
        for engine in engines:
            engine.dispose(close=False)  # the parent's connections (none, by keep_store_open) are not this child's
        if _file_identity(Path(uri.removeprefix("sqlite:///"))) != opened:
            compat_mlflow.forget_stores(mlflow.tracking)
            _KEPT.clear()
            _WAL.clear()
            return


def _write_ahead_log(db: Path) -> None:
    """Put a SQLite store in write-ahead-log mode, which the file keeps: every process that opens it later (stage
    processes, `mlflow ui`) uses it too. A commit then appends to the log and syncs it once: 4-5 ms a write
    instead of 17-24 ms with the rollback journal (a file created, synced and deleted per commit), and readers no
    longer block writers. Durability is unchanged (SQLite's default FULL sync). A store another process holds in a
    transaction stays as it is this time (SQLite refuses the switch then; the next process switches it)."""
    if not db.parent.is_dir():
        return  # no store here yet: MLflow makes it, and the next process that opens it switches it
    with contextlib.suppress(sqlite3.Error), contextlib.closing(sqlite3.connect(db, timeout=1.0)) as conn:
        conn.execute("PRAGMA journal_mode=WAL").fetchall()


class ArtifactLocationError(ValueError):
    """An experiment whose stored artifact location is not the configured one."""


def experiment_id(c: MlflowClient, name: str, artifact_uri: str | None) -> str:
    """The experiment ``name``, created with its artifact location under ``artifact_uri``.

    An existing experiment keeps the location it was created with (MLflow cannot move it), so one that
    lies elsewhere is refused: its models and reports would land outside the configured store.

    In a tracking server's own store (``mlflow-artifacts:/``) the server places the experiment
    (``mlflow-artifacts:/<experiment id>``): its auth app decides who may write an artifact from the
    experiment id that leads the path, and lets no one but its admin write under a name.
    """
    server_store = artifact_uri is not None and artifact_uri.rstrip("/") == SERVER_ARTIFACTS.rstrip("/")
    wanted = f"{artifact_uri.rstrip('/')}/{name}" if artifact_uri and not server_store else None
    exp = c.get_experiment_by_name(name)
    if exp is None:
        return c.create_experiment(name, artifact_location=wanted)
    if server_store and not exp.artifact_location.startswith(SERVER_ARTIFACTS.rstrip("/")):
        raise ArtifactLocationError(
            f"experiment {name!r} stores its artifacts at {redact(exp.artifact_location)}, but TRAINGATE_ARTIFACT_URI "
            f"puts them in the tracking server's store ({SERVER_ARTIFACTS}); use a new identity.experiment, or set "
            f"TRAINGATE_ARTIFACT_URI to {redact(exp.artifact_location.rstrip('/').rsplit('/', 1)[0])}"
        )
    if wanted is not None and exp.artifact_location.rstrip("/") != wanted:
        raise ArtifactLocationError(
            f"experiment {name!r} stores its artifacts at {redact(exp.artifact_location)}, but TRAINGATE_ARTIFACT_URI "
            f"puts them at {redact(wanted)}; use a new identity.experiment, or set TRAINGATE_ARTIFACT_URI to "
            f"{redact(exp.artifact_location.rstrip('/').rsplit('/', 1)[0])}"
        )
    return exp.experiment_id


class RequestKey(str):
    """A request key that says whether it is new: made for the first attempt of its request, so that no run can
    carry it yet and :func:`create_run_once` looks for none (a search of the experiment's tags per run created)."""

    fresh: bool

    def __new__(cls, key: str, fresh: bool) -> RequestKey:
        made = super().__new__(cls, key)
        made.fresh = fresh
        return made


def create_run_once(c: MlflowClient, experiment: str, request_key: str, run_name: str, tags: dict[str, str]) -> Run:
    """Create a run for one request, or return the run an earlier attempt of the same request created.

    The key is a tag written by the same call that creates the run, so no run exists without it:
    a retry whose first attempt created the run and then failed (or lost the reply) finds that run
    instead of creating a second one. Everything the callers write after creation is safe to
    write again (same params, tags and artifacts overwritten with the same values). A fresh
    :class:`RequestKey` is not looked for.
    """
    if not _REQUEST_KEY.fullmatch(request_key):
        raise ValueError(
            f"request_key = {request_key!r}: use 1-200 letters, digits or '_.:-' (it names one "
            "create request; its retries pass the same key)"
        )
    fresh = isinstance(request_key, RequestKey) and request_key.fresh
    found = [] if fresh else c.search_runs([experiment], f"tags.`{REQUEST_KEY_TAG}` = '{request_key}'", max_results=2)
    if not found:
        return c.create_run(experiment, run_name=run_name, tags={**tags, REQUEST_KEY_TAG: request_key})
    run = found[0]
    if len(found) > 1 or run.info.run_name not in (run_name, unique_name(run_name, run.info.run_id)):
        names = ", ".join(f"{r.info.run_id} ({r.info.run_name!r})" for r in found)
        raise ValueError(
            f"request_key = {request_key!r} already names run(s) {names}, not a run {run_name!r}; "
            "a key names one create request: pass a new key for a new run"
        )
    return run


def open_pipeline_run(
    c: MlflowClient,
    spec: RunSpec,
    artifact_uri: str | None,
    identity: dict[str, Any],
    *,
    request_key: str,
    validate: bool = True,
) -> str:
    """Create the parent run with the full identity; returns its id (the traingate run id).

    Idempotent per ``request_key`` (see :func:`create_run_once`). ``validate``: check the stored identity and tag
    the verdict now (:func:`validate_identity`); a caller with other work runs that beside it. Without
    ``identity["environment"]`` the run gets its tags only (what its stage runs inherit as they open): the caller
    writes the rest with :func:`fill_pipeline_run`.
    """
    exp = experiment_id(c, spec.identity.experiment, artifact_uri)
    name = _base_name(spec)
    # Its tags come with its creation, its id right after; its unique name with the rest of its identity
    # (fill_pipeline_run: MLflow renames a run whose mlflow.runName tag is written, a write of its own).
    tags = {
        "traingate.kind": "pipeline",
        "traingate.experiment": spec.identity.experiment,
        "traingate.owner": spec.identity.owner,
        "traingate.team": spec.identity.team,
        "traingate.purpose": spec.identity.purpose,
        "traingate.recipe": spec.recipe.name,
        "traingate.code_version": identity["code"]["sha"],
        "traingate.code_dirty": identity["code"]["dirty"],
        "traingate.code_diff_hash": identity["code"].get("diff_hash", ""),
        "traingate.code_source": identity["code"].get("source", ""),
        "traingate.data_snapshot": identity["data_snapshot"],
        "traingate.data_uri": identity["data_uri"],
        "traingate.spec_hash": spec.spec_hash(),
        "traingate.work_pool": spec.resources.work_pool,
        **standard.standard_tags(spec, identity["code"], name),
    }
    run = create_run_once(c, exp, request_key, name, {k: redact(str(v)) for k, v in tags.items()})
    rid = run.info.run_id
    c.set_tag(rid, "traingate.run_id", rid)
    if "environment" in identity:
        fill_pipeline_run(c, rid, spec, identity["environment"], validate=validate)
    return rid


def fill_pipeline_run(
    c: MlflowClient, rid: str, spec: RunSpec, environment: dict[str, Any], validate: bool = True
) -> list[str]:
    """The rest of a pipeline run's identity: its unique name, the spec as params and as an artifact, the environment
    snapshot; then the identity check (``validate``), whose missing parts it returns. Safe to repeat (same values)."""
    c.set_tag(rid, "mlflow.runName", unique_name(_base_name(spec), rid))
    params = [Param(k, redact(v)[:_MAX_PARAM]) for k, v in sorted(spec.flat().items())]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params (and 100 tags) in one batch
        c.log_batch(rid, params=params[i : i + 100])
    c.log_dict(rid, redact_mapping(spec.to_dict()), SPEC_ARTIFACT)
    c.log_dict(rid, redact_mapping(environment), ENVIRONMENT_ARTIFACT)
    return validate_identity(c, rid) if validate else []


def _base_name(spec: RunSpec) -> str:
    return spec.identity.run_name or f"{spec.recipe.name}-{spec.spec_hash()[:6]}"


def pipeline_name(name: str, run_id: str) -> str:
    """A pipeline run's unique name from its stored name, whether or not the rename that gives it has been written.

    >>> rid = "7d1e0b2a9c4f4e0d8b6a5c3e2f1a0b9c"
    >>> pipeline_name("digits-cnn-3f9a2c", rid), pipeline_name("digits-cnn-3f9a2c-7d1e0b2a", rid)
    ('digits-cnn-3f9a2c-7d1e0b2a', 'digits-cnn-3f9a2c-7d1e0b2a')
    """
    return name if name.endswith(f"-{run_id[:8]}") else unique_name(name, run_id)


def unique_name(name: str, run_id: str) -> str:
    """A pipeline run's MLflow name: readable (recipe and spec hash, or identity.run_name) and unique,
    ending in the start of the traingate run id the CLI prints (the same spec runs many times).

    >>> unique_name("digits-cnn-3f9a2c", "7d1e0b2a9c4f4e0d8b6a5c3e2f1a0b9c")
    'digits-cnn-3f9a2c-7d1e0b2a'
    """
    return f"{name}-{run_id[:8]}"


# ------------------------------------------------------------------ identity


def identity_problems(c: MlflowClient, run: Run) -> list[str]:
    """What a run lacks of its identity (empty when complete). Checked on the stored run, not on intent."""
    tags, params = run.data.tags, run.data.params
    problems = [t for t in REQUIRED_TAGS if tags.get(t) in (None, "", "unknown", "undeclared")]
    if tags.get("traingate.code_dirty") == "true" and not tags.get("traingate.code_diff_hash"):
        problems.append("traingate.code_diff_hash")
    exp = c.get_experiment(run.info.experiment_id)
    if tags.get("traingate.experiment") and exp.name != tags["traingate.experiment"]:
        problems.append(f"experiment (run is in {exp.name!r}, identity says {tags['traingate.experiment']!r})")
    if not run.info.run_name:
        problems.append("run name")
    if "identity.experiment" not in params or "recipe.name" not in params:
        problems.append("resolved spec as params")
    repo = _artifact_repo(c, run)
    for artifact in (SPEC_ARTIFACT, ENVIRONMENT_ARTIFACT):
        folder = artifact.rsplit("/", 1)[0]
        if artifact not in {a.path for a in repo.list_artifacts(folder)}:
            problems.append(f"artifact {artifact}")
    if tags.get("traingate.kind") == "stage":
        problems += [t for t in ("traingate.stage", "mlflow.parentRunId") if not tags.get(t)]
    elif tags.get("traingate.kind") != "pipeline":
        problems.append("traingate.kind")
    return problems


def _artifact_repo(c: MlflowClient, run: Run) -> ArtifactRepository:
    """The artifact location of a run read already. MlflowClient's artifact calls by run id (``runs:/``) read the
    run twice more and look for logged models there (9 ms a call on SQLite, more beside other writes)."""
    return get_artifact_repository(run.info.artifact_uri, tracking_uri=c.tracking_uri)


def validate_identity(c: MlflowClient, run_id: str, run: Run | None = None) -> list[str]:
    """Check a run's identity and tag the verdict on it (``traingate.identity_valid``/``_missing``). ``run``: the
    stored run, read already by the caller (None: read here)."""
    run = run if run is not None else c.get_run(run_id)
    problems = identity_problems(c, run)
    verdict = {
        "traingate.identity_valid": str(not problems).lower(),
        "traingate.identity_missing": "; ".join(problems)[:5000],
    }
    if any(run.data.tags.get(k) != v for k, v in verdict.items()):  # a verdict tagged already is not written again
        c.log_batch(run_id, tags=[RunTag(k, v) for k, v in verdict.items()])
    return problems


def can_promote(c: MlflowClient, run_id: str, run: Run | None = None) -> tuple[bool, list[str]]:
    """Whether a stage run may be registered as a model: full stage, completed, gate passed, identity complete.

    The identity is re-checked on the stored run (and its parent) at the moment of promotion. ``run``: the stored
    run, read already by the caller (None: read here).
    """
    run = run if run is not None else c.get_run(run_id)
    tags = run.data.tags
    reasons = [f"identity incomplete: {p}" for p in validate_identity(c, run_id, run)]
    parent = tags.get("mlflow.parentRunId")
    if parent:
        reasons += [f"pipeline run identity incomplete: {p}" for p in validate_identity(c, parent)]
    if tags.get("traingate.stage") != "full":
        reasons.append(f"only the full stage is promoted, this is {tags.get('traingate.stage')!r}")
    if tags.get("traingate.stage_status") != "completed":
        reasons.append(f"stage status is {tags.get('traingate.stage_status')!r}, not 'completed'")
    if tags.get("traingate.gate_passed") != "true":
        reasons.append("its gate did not pass")
    return not reasons, reasons


# ------------------------------------------------------------------ stages


def open_stage_run(c: MlflowClient, parent_run_id: str, stage: str, *, request_key: str) -> str:
    """A child run for one stage, carrying the parent's identity: tags, spec params and identity artifacts.

    Idempotent per ``request_key`` (see :func:`create_run_once`): :func:`create_stage_run`, then
    :func:`fill_stage_run` (a caller with something else to do runs the second beside it).
    """
    rid = create_stage_run(c, parent_run_id, stage, request_key=request_key)
    fill_stage_run(c, parent_run_id, rid, stage)
    return rid


def create_stage_run(c: MlflowClient, parent_run_id: str, stage: str, *, request_key: str) -> str:
    """The stage's child run with the parent's identity tags (its name, kind, stage and parent with them): the
    id a training process writes to. Idempotent per ``request_key`` (see :func:`create_run_once`).

    The parent is read once per process: what a stage inherits of it (its identity) is written as it opens."""
    parent = _PARENTS.get(parent_run_id) or _PARENTS.setdefault(parent_run_id, c.get_run(parent_run_id))
    inherited = {
        k: v
        for k, v in parent.data.tags.items()
        if k.startswith("traingate.")
        and k not in ("traingate.kind", "traingate.identity_valid", "traingate.identity_missing", REQUEST_KEY_TAG)
        and not k.startswith(NOTE_PREFIX)
    }
    run = create_run_once(
        c,
        parent.info.experiment_id,
        request_key,
        f"{pipeline_name(parent.info.run_name, parent_run_id)}/{stage}",
        {
            **inherited,
            "mlflow.parentRunId": parent_run_id,
            "traingate.kind": "stage",
            "traingate.stage": stage,
            "traingate.pipeline_run_id": parent_run_id,
            **{k: v for k, v in parent.data.tags.items() if k.startswith(_INHERITED_STANDARD_TAGS)},
        },
    )
    return run.info.run_id  # MLflow's store tags it with its name (mlflow.runName) as it creates it


_PARENTS: dict[str, Run] = {}  # pipeline run id -> the run as its first stage run read it


def fill_stage_run(c: MlflowClient, parent_run_id: str, rid: str, stage: str) -> None:
    """The rest of a stage run's identity, from its parent: the data snapshot as its input (the stages that
    train), the spec params and the identity artifacts; then the identity check. Safe to repeat (same values)."""
    parent = c.get_run(parent_run_id)
    if stage != "unit":  # the stages that train on the data snapshot take it as their input
        _log_dataset(
            c, rid, parent.data.tags.get("traingate.data_snapshot", ""), parent.data.tags.get("traingate.data_uri", "")
        )
    params = [Param(k, v) for k, v in sorted(parent.data.params.items())]
    for i in range(0, len(params), 100):
        c.log_batch(rid, params=params[i : i + 100])
    source = _artifact_repo(c, parent)
    with tempfile.TemporaryDirectory() as tmp:
        for artifact in (SPEC_ARTIFACT, ENVIRONMENT_ARTIFACT):
            local = source.download_artifacts(artifact, tmp)
            c.log_artifact(rid, local, artifact.rsplit("/", 1)[0])
    validate_identity(c, rid)


# The standard tags a stage run shares with its pipeline run (its own name is its own).
_INHERITED_STANDARD_TAGS = ("mlflow.source.", "mlflow.user")


def _log_dataset(c: MlflowClient, run_id: str, data_snapshot: str, data_uri: str) -> None:
    """The data snapshot as the run's dataset input (MLflow's Dataset column); nothing when no data is declared.
    Logging it again is a no-op: MLflow keys a dataset by name and digest and an input by dataset and run."""
    fields = standard.dataset_fields(data_snapshot, data_uri)
    if fields is None:
        return
    dataset = Dataset(fields.name, fields.digest, fields.source_type, fields.source, profile=fields.profile)
    c.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "training")])])


def record_stage(c: MlflowClient, stage_run_id: str, result: StageResult, decision: GateDecision | None) -> None:
    """Log a stage's result, gate decision, eval outputs (a confusion matrix also as a PNG) and checkpoint URIs, then
    close its run."""
    # At the step the stage reached and the time it is recorded: a stage recorded again after a resume
    # (a preempted attempt's result first) has its newer values read back as the latest, never the older.
    now_ms, step = int(time.time() * 1000), int(result.metrics.get("steps") or 0)
    summary = {f"stage.{k}": v for k, v in result.numeric_metrics().items()}
    summary.update({"stage.cost_usd": result.cost_usd, "stage.duration_s": result.duration_s})
    summary.update({f"estimate.{k}": float(v) for k, v in result.estimate.items()})
    metrics = [Metric(k, float(v), now_ms, step) for k, v in summary.items()]
    # A script's curves, read from its output: logged with their steps and the time each line was read.
    for name, points in (result.details.get("series") or {}).items():
        metrics += [Metric(name, float(p[1]), int(p[2] * 1000) if len(p) > 2 else now_ms, int(p[0])) for p in points]
    tags = [RunTag("traingate.stage_status", result.status)]
    if "restarts" in result.details:  # the supervisor's record, the one every restart count reads
        tags += [RunTag(k, v) for k, v in restart_record.tags(result.details["restarts"]).items()]
    if result.checkpoint_uri:
        tags.append(RunTag("traingate.checkpoint_uri", redact(result.checkpoint_uri)))
    if decision is not None:
        tags += [
            RunTag("traingate.gate_passed", str(decision.passed).lower()),
            RunTag("traingate.gate_reasons", redact("; ".join(decision.reasons))[:5000]),
        ]
    for i in range(0, len(metrics), 500):
        c.log_batch(stage_run_id, metrics=metrics[i : i + 500], tags=tags if i == 0 else [])
    c.log_text(stage_run_id, redact(render_markdown(result, decision)), "gate/report.md")
    c.log_text(stage_run_id, redact(json.dumps(result.to_dict(), indent=1, default=str)), "stage/result.json")
    _log_eval_outputs(c, stage_run_id, result.details.get("eval") or {})
    _log_checkpoint_uris(c, stage_run_id, result.checkpoint_uri)
    validate_identity(c, stage_run_id)
    ok = result.status == "completed" and (decision is None or decision.passed)
    c.set_terminated(stage_run_id, "FINISHED" if ok else "FAILED")


def _log_eval_outputs(c: MlflowClient, run_id: str, evals: dict[str, Any]) -> None:
    """Eval outputs that are not numbers: a confusion matrix (JSON + PNG), text samples, anything else as JSON."""
    for name, value in evals.items():
        if isinstance(value, str):
            c.log_text(run_id, redact(value), f"eval/{name}.txt")
            continue
        c.log_text(run_id, redact(json.dumps(value, indent=1, default=str)), f"eval/{name}.json")
        if name.startswith("confusion") and isinstance(value, list) and value and isinstance(value[0], list):
            c.log_figure(run_id, plots.confusion_matrix(value), f"eval/{name}.png")


def _log_checkpoint_uris(c: MlflowClient, run_id: str, root: str | None) -> None:
    """Checkpoints are referenced by URI, never copied into the artifact store."""
    if not root:
        return
    steps = CheckpointCatalog(root).list_steps()
    index: dict[str, Any] = {"root": redact(root), "steps": {str(s): redact(join(root, step_dir(s))) for s in steps}}
    c.log_text(run_id, json.dumps(index, indent=1), "checkpoints/index.json")
    if steps:
        c.set_tag(run_id, "traingate.checkpoint.latest_uri", index["steps"][str(steps[-1])])


def run_cost_usd(stages: list[Run]) -> float:
    """A pipeline run's cost: its stages' ``stage.cost_usd``, each the ledger's charge of that stage's attempts
    (``traingate.cost.ledger.total_usd``). ``pipeline.cost_usd``, `traingate runs` and `show` read it, so they
    add up what `traingate cost` and `traingate watch` charge."""
    return sum(s.data.metrics.get("stage.cost_usd", 0.0) for s in stages)


def close_pipeline_run(c: MlflowClient, run_id: str, passed: bool, reached: str, reason: str = "") -> None:
    """Close the pipeline run with its outcome, restarts and headline metrics: final ``val_loss``, throughput
    and ``cost_usd``, the sum of its stages' ``stage.cost_usd`` (:func:`.standard.headline_metrics`)."""
    children = stage_runs(c, run_id)
    cost = run_cost_usd(children)
    restarts = sum(restart_count(r) for r in children)
    headline = standard.headline_metrics([r.data.metrics for r in children], cost)
    now_ms = int(time.time() * 1000)
    c.log_batch(
        run_id,
        metrics=[
            Metric("pipeline.cost_usd", cost, 0, 0),
            Metric("pipeline.restarts", restarts, 0, 0),
            *(Metric(k, v, now_ms, 0) for k, v in headline.items()),
        ],
        tags=[
            RunTag("traingate.reached_stage", reached),
            RunTag("traingate.outcome", "passed" if passed else "stopped"),
            RunTag("traingate.stop_reason", redact(reason)[:5000]),
        ],
    )
    c.set_terminated(run_id, "FINISHED" if passed else "FAILED")


def stage_runs(c: MlflowClient, pipeline_run_id: str, experiment_id: str | None = None) -> list[Run]:
    """The stage runs of a pipeline run, in ladder order. ``experiment_id``: the pipeline run's, known already."""

    known = _PARENTS.get(pipeline_run_id)  # its experiment, where this process opened its stage runs
    exp = experiment_id or (known or c.get_run(pipeline_run_id)).info.experiment_id
    runs = c.search_runs([exp], f"tags.mlflow.parentRunId = '{pipeline_run_id}'", max_results=1000)
    order = {s: i for i, s in enumerate(STAGES)}
    return sorted(runs, key=lambda r: (order.get(r.data.tags.get("traingate.stage", ""), 99), r.info.start_time))


# ------------------------------------------------------------------ the logbook


def add_note(c: MlflowClient, run_id: str, text: str, author: str) -> dict[str, Any]:
    """Add a timestamped note to a run's logbook (a tag per note; also shown as the run's MLflow description)."""
    if not text.strip():
        raise ValueError('a note needs text, e.g. traingate note RUN_ID "why we lowered the LR"')
    now = time.time()
    note = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "author": redact(author),
        "text": redact(text),
    }
    c.set_tag(run_id, f"{NOTE_PREFIX}{int(now * 1000)}", json.dumps(note)[:8000])
    logbook = notes(c.get_run(run_id))
    c.set_tag(
        run_id,
        "mlflow.note.content",
        "\n\n".join(f"**{n['time']}** {n['author']}: {n['text']}" for n in logbook)[:8000],
    )
    return note


def notes(run: Run) -> list[dict[str, Any]]:
    keys = sorted((k for k in run.data.tags if k.startswith(NOTE_PREFIX)), key=lambda k: int(k[len(NOTE_PREFIX) :]))
    return [json.loads(run.data.tags[k]) for k in keys]


def restarts(run: Run) -> list[dict[str, str]]:
    """The restarts of a (stage) run, numbered in order: once the stage is recorded, the supervisor's
    record (:mod:`traingate.tracking.restarts`); while it runs, what its rank 0 tracker tagged so far
    (number, cause, step resumed from, time lost), failures and preemptions only (:func:`is_restart`)."""
    tags = run.data.tags
    recorded = restart_record.from_tags(tags)
    if recorded is not None:
        return recorded[1]
    listed: list[dict[str, str]] = []
    for i in range(1, int(tags.get("traingate.restarts", "0")) + 1):
        p = f"traingate.restart.{i}."
        listed.append({k[len(p) :]: v for k, v in tags.items() if k.startswith(p)})
    counted = [r for r in listed if is_restart(r.get("cause"))]
    return [{"n": str(n), **r} for n, r in enumerate(counted, 1)]


def restart_count(run: Run) -> int:
    recorded = restart_record.from_tags(run.data.tags)
    return recorded[0] if recorded is not None else len(restarts(run))


# ------------------------------------------------------------------ a lost tracking store
# MLflow's REST client turns a refused connection, a timeout and too many 5xx answers into these.
_UNREACHABLE_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"}


def store_unreachable(e: BaseException) -> bool:
    """Whether an MLflow call failed because the tracking store could not be reached (not because it refused).

    >>> from mlflow.exceptions import MlflowException
    >>> store_unreachable(MlflowException("API request to http://h/api failed with exception ..."))
    True
    >>> from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
    >>> store_unreachable(MlflowException("bad", error_code=INVALID_PARAMETER_VALUE))
    False
    """

    if isinstance(e, MlflowException):
        return e.error_code in _UNREACHABLE_CODES
    return isinstance(e, (requests.RequestException, ConnectionError, TimeoutError, sqlalchemy.exc.OperationalError))
