"""MLflow's own vocabulary for traingate's runs, so its run table and compare view need no traingate knowledge.

- the standard tags MLflow's columns read: source (name, type, git commit), user, run name;
- the data snapshot as a dataset input (name, digest, source), on the stage runs that train on it;
- a pipeline run's headline metrics (final ``val_loss``, ``cost_usd``, throughput), read from its stages;
- a link to a run in the MLflow UI, for the Prefect artifacts that report a stage.

Plain values only, no MLflow import: :mod:`traingate.tracking.runs` hands them to the client and the
Prefect tasks build links with them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from traingate.redact import redact

# A traingate run is started by an orchestrator (a flow run, CI, a schedule), not from a notebook or a
# script run by hand: MLflow's SourceType for that is JOB.
SOURCE_TYPE = "JOB"
# Code versions that name a git commit: read from a checkout, or stamped into an installed copy at build time.
_COMMIT_SOURCES = ("git", "stamp")
# MLflow's datasets table keys a dataset by name and digest; the digest column holds 36 characters.
DIGEST_CHARS = 36
HEADLINE = ("val_loss", "samples_per_s", "steps_per_s")


def source_name(spec: Any) -> str:
    """What MLflow's Source column shows: a script recipe's command line, else the built-in recipe.

    >>> from traingate.spec import load_spec_text
    >>> source_name(load_spec_text("identity: {experiment: e, owner: o, team: t, purpose: p}\\n"
    ...                            "recipe: {name: digits-cnn}\\n"))
    'traingate recipe digits-cnn'
    """
    script = spec.recipe.script
    if script is not None:
        return redact(" ".join(script.command))[:500]
    return f"traingate recipe {spec.recipe.name}"


def standard_tags(spec: Any, code: Mapping[str, str], run_name: str) -> dict[str, str]:
    """MLflow's standard tags of a run: source name and type, the code's commit (a git or stamped
    version only: a content hash is no commit), the user (``identity.owner``, the person the run is
    for) and the run name.

    >>> from traingate.spec import load_spec_text
    >>> spec = load_spec_text("identity: {experiment: e, owner: ada, team: t, purpose: p}\\n"
    ...                       "recipe: {name: digits-cnn}\\n")
    >>> tags = standard_tags(spec, {"sha": "a" * 40, "source": "git"}, "digits-cnn-3f9a2c-7d1e0b2a")
    >>> tags["mlflow.source.git.commit"] == "a" * 40, tags["mlflow.user"], tags["mlflow.source.type"]
    (True, 'ada', 'JOB')
    >>> "mlflow.source.git.commit" in standard_tags(spec, {"sha": "sha256:00", "source": "content"}, "r")
    False
    """
    tags = {
        "mlflow.source.name": source_name(spec),
        "mlflow.source.type": SOURCE_TYPE,
        "mlflow.user": spec.identity.owner,
        "mlflow.runName": run_name,
    }
    if code.get("source") in _COMMIT_SOURCES and code.get("sha", "unknown") != "unknown":
        tags["mlflow.source.git.commit"] = code["sha"]
    return tags


@dataclass(frozen=True)
class DatasetFields:
    """The fields of an MLflow dataset input (``mlflow.entities.Dataset``), as plain strings."""

    name: str
    digest: str
    source_type: str
    source: str  # JSON, as MLflow's own dataset sources serialise themselves: {"uri": ...}
    profile: str  # JSON: the full snapshot id, which the digest column cannot always hold


_SOURCE_TYPES = {"": "local", "file": "local", "s3": "s3", "http": "http", "https": "http", "gs": "gcs"}


def dataset_fields(data_snapshot: str, data_uri: str) -> DatasetFields | None:
    """The data snapshot a run trains on as an MLflow dataset input; None when the run declares no data.

    >>> d = dataset_fields("dir-" + "0f" * 32, "s3://corpora/shakespeare/v3/")
    >>> d.name, d.digest, d.source_type, json.loads(d.source)
    ('v3', 'dir-0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f', 's3', {'uri': 's3://corpora/shakespeare/v3/'})
    >>> dataset_fields("undeclared", "undeclared") is None
    True
    """
    if data_snapshot in ("", "unknown", "undeclared") or data_uri in ("", "undeclared"):
        return None
    uri = redact(data_uri)
    parts = urlsplit(uri)
    name = next((p for p in reversed(parts.path.split("/")) if p), "") or parts.netloc or uri
    return DatasetFields(
        name=name[:500],
        digest=data_snapshot[:DIGEST_CHARS],
        source_type=_SOURCE_TYPES.get(parts.scheme.lower(), parts.scheme.lower()),
        source=json.dumps({"uri": uri}),
        profile=json.dumps({"snapshot": data_snapshot}),
    )


def headline_metrics(stages: Sequence[Mapping[str, float]], cost_usd: float) -> dict[str, float]:
    """A pipeline run's headline metrics from its stage runs' metrics (ladder order): each from the last
    stage that measured it (the furthest the run got), and the run's total cost.

    ``val_loss``: the stage's final evaluation; ``samples_per_s``: its training throughput;
    ``steps_per_s``: one over its mean step time (a script's too, which may count no samples).

    >>> headline_metrics([{"stage.val_loss": 0.9, "stage.step_time_mean_s": 0.5},
    ...                   {"stage.val_loss": 0.4, "stage.samples_per_s": 640.0, "stage.step_time_mean_s": 0.1}], 0.25)
    {'val_loss': 0.4, 'steps_per_s': 10.0, 'samples_per_s': 640.0, 'cost_usd': 0.25}
    """
    out: dict[str, float] = {}
    for metrics in stages:
        if "stage.val_loss" in metrics:
            out["val_loss"] = float(metrics["stage.val_loss"])
        if metrics.get("stage.samples_per_s"):
            out["samples_per_s"] = float(metrics["stage.samples_per_s"])
        if metrics.get("stage.step_time_mean_s"):
            out["steps_per_s"] = 1.0 / float(metrics["stage.step_time_mean_s"])
    out["cost_usd"] = float(cost_usd)
    return out


def run_url(tracking_uri: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI of a tracking server (its ``/#/runs/<id>`` route); None for a
    store without a UI of its own (a file or database URI). Credentials in the URI are left out.

    >>> run_url("http://svc:pw@mlflow.internal:5000/", "7d1e0b2a")
    'http://mlflow.internal:5000/#/runs/7d1e0b2a'
    >>> run_url("sqlite:///state/mlflow.db", "7d1e0b2a") is None
    True
    """
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https"):
        return None
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path.rstrip("/") + "/", "", "")) + f"#/runs/{run_id}"


def run_link(tracking_uri: str, run_id: str) -> str:
    """A markdown line that leads to the run: a link to a tracking server's UI, else the store and how
    to open it (``mlflow ui`` on the store, then the same route).

    >>> run_link("https://mlflow.example.org", "ab12")
    'MLflow run: [ab12](https://mlflow.example.org/#/runs/ab12)'
    >>> run_link("sqlite:////srv/tg/mlflow.db", "ab12")  # doctest: +NORMALIZE_WHITESPACE
    'MLflow run: `ab12` in `sqlite:////srv/tg/mlflow.db` (open with `mlflow ui --backend-store-uri
    sqlite:////srv/tg/mlflow.db`, then /#/runs/ab12)'
    """
    url = run_url(tracking_uri, run_id)
    if url is not None:
        return f"MLflow run: [{run_id}]({url})"
    store = redact(tracking_uri)
    opened = f"open with `mlflow ui --backend-store-uri {store}`, then /#/runs/{run_id}"
    return f"MLflow run: `{run_id}` in `{store}` ({opened})"
