"""Prefect artifact boundary: each stage's report as a markdown table in the UI."""

from __future__ import annotations

import re

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from traingate.job.result import GateDecision, StageResult, render_markdown
from traingate.redact import redact
from traingate.spec import STAGES


def artifact_key(run_id: str, stage: str) -> str:
    """One key per run and stage, sorting in ladder order (Prefect keys: lowercase letters, digits, dashes).

    >>> artifact_key("7d1e0b2a9c4f4e0d8b6a5c3e2f1a0b9c", "canary")
    'tg-7d1e0b2a9c4f4e0d8b6a5c3e2f1a0b9c-3-canary'
    """
    return re.sub(r"[^a-z0-9-]+", "-", f"tg-{run_id}-{STAGES.index(stage) + 1}-{stage}".lower())


@task(name="publish-stage-report", task_run_name="report-{result.stage}", cache_policy=NONE)
def publish_stage_report(run_id: str, result: StageResult, decision: GateDecision | None) -> None:
    create_markdown_artifact(
        markdown=redact(render_markdown(result, decision)),
        key=artifact_key(run_id, result.stage),
        description=f"traingate run {run_id}: stage {result.stage} ({result.status})",
    )
