"""Prefect artifact boundary: each stage's report as a markdown table in the UI, linked to its MLflow run."""

from __future__ import annotations

import re

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from traingate.job.result import GateDecision, StageResult, render_markdown
from traingate.redact import redact
from traingate.settings import Settings
from traingate.spec import STAGES
from traingate.tracking.standard import run_link


def artifact_key(run_id: str, stage: str) -> str:
    """One key per run and stage, sorting in ladder order (Prefect keys: lowercase letters, digits, dashes).

    >>> artifact_key("7d1e0b2a9c4f4e0d8b6a5c3e2f1a0b9c", "canary")
    'tg-7d1e0b2a9c4f4e0d8b6a5c3e2f1a0b9c-3-canary'
    """
    return re.sub(r"[^a-z0-9-]+", "-", f"tg-{run_id}-{STAGES.index(stage) + 1}-{stage}".lower())


@task(name="publish-stage-report", task_run_name="report-{result.stage}", cache_policy=NONE)
def publish_stage_report(
    run_id: str, result: StageResult, decision: GateDecision | None, mlflow_run_id: str | None = None
) -> None:
    """The report, with a link to the stage's MLflow run under its title (``mlflow_run_id``: None, an untracked run)."""
    report = render_markdown(result, decision)
    if mlflow_run_id:
        title, _, rest = report.partition("\n\n")
        report = f"{title}\n\n{run_link(Settings.from_env().tracking_uri, mlflow_run_id)}\n\n{rest}"
    create_markdown_artifact(
        markdown=redact(report),
        key=artifact_key(run_id, result.stage),
        description=f"traingate run {run_id}: stage {result.stage} ({result.status})",
    )
