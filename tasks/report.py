"""Prefect artifact boundary: each stage's report as a markdown table in the UI."""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from traingate.redact import redact
from traingate.stage import GateDecision, StageResult, render_markdown


@task(name="publish-stage-report", cache_policy=NONE)
def publish_stage_report(run_id: str, result: StageResult, decision: GateDecision | None) -> None:
    create_markdown_artifact(
        markdown=redact(render_markdown(result, decision)),
        key=f"stage-{result.stage}",
        description=f"traingate run {run_id}: stage {result.stage} ({result.status})")
