"""Where the ledger's attempts come from: the runs MLflow holds.

A pipeline run (tag ``traingate.kind = pipeline``) carries its team, experiment, outcome
(``traingate.outcome = passed`` when every stage passed) and its resolved spec
(``spec/resolved_spec.json``). Each of its stage runs holds ``stage/result.json``, the
StageResult, whose ``attempts`` are the attempts as charged when the stage ended (pool, slots,
price, start, end, backoff, idle, outcome, dollars; :func:`traingate.ladder.outcomes.from_supervision`),
and whose ``estimated_cost_usd`` is what the stage before it estimated. A result recorded before
attempts were is charged from its ``details.supervision.attempts`` at the slots and price the spec
gives the stage (:func:`traingate.job.world.stage_world`, :func:`traingate.job.sizing.slots`).

Not covered: sweep trials (their runs record a total cost, ``trial.cost_usd``, not attempts) and
stages that have not ended (no result yet); :class:`Gathered` counts the stages it skipped.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.entities import Run as MlflowRun
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from traingate.capacity.pools import TeamBudget
from traingate.cost.budget import BudgetLeft, budget_left
from traingate.cost.ledger import Attempt, Run, attempts_of
from traingate.job import sizing
from traingate.job.world import stage_world
from traingate.spec import RunSpec, parse_spec
from traingate.tracking.runs import SPEC_ARTIFACT, stage_runs

RESULT_ARTIFACT = "stage/result.json"


def stage_attempts(run_id: str, stage: str, spec: RunSpec, result: dict[str, Any]) -> list[Attempt]:
    """A recorded StageResult's attempts: its ``attempts`` records (pool, slots, price as charged, the
    smoke's stop-and-resume included), or, for a result written before they were recorded, its
    supervision's attempts charged at the slots and price the spec gives the stage."""
    if result.get("attempts"):
        return [Attempt.from_record(run_id, r) for r in result["attempts"]]
    nodes, nproc = stage_world(spec, stage)
    return attempts_of(
        run_id,
        stage,
        ((result.get("details") or {}).get("supervision") or {}).get("attempts") or [],
        spec.resources.work_pool,
        sizing.slots(nodes * nproc),
        spec.pool.price_per_gpu_hour,
    )


@dataclass
class Gathered:
    runs: list[Run] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "<run id>/<stage>: why", for the report's footnote


def _download_json(c: MlflowClient, run_id: str, path: str) -> Any | None:
    names = {f.path for f in c.list_artifacts(run_id, path.rsplit("/", 1)[0])}
    if path not in names:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(c.download_artifacts(run_id, path, tmp)).read_text())


def _experiment_ids(c: MlflowClient, experiment: str | None) -> list[str]:
    if experiment is None:
        return [e.experiment_id for e in c.search_experiments()]
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(
            f"experiment = {experiment!r}: no such experiment in the tracking store; "
            "leave --experiment out to report all"
        )
    return [exp.experiment_id]


def _pipeline(c: MlflowClient, run_id: str) -> MlflowRun:
    try:
        run = c.get_run(run_id)
    except MlflowException:
        run = None
    if run is None or run.data.tags.get("traingate.kind") != "pipeline":
        raise ValueError(f"--run = {run_id!r}: no pipeline run with this id; `traingate runs` lists them")
    return run


def _pipelines(c: MlflowClient, experiment: str | None, team: str | None, since_ms: int | None) -> list[MlflowRun]:
    where = ["tags.`traingate.kind` = 'pipeline'"]
    if team is not None:
        where.append(f"tags.`traingate.team` = '{team}'")
    if since_ms is not None:
        where.append(f"attributes.start_time >= {int(since_ms)}")
    out: list[MlflowRun] = []
    token = None
    while True:
        page = c.search_runs(_experiment_ids(c, experiment), " and ".join(where), max_results=1000, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def gather(
    c: MlflowClient,
    *,
    experiment: str | None = None,
    team: str | None = None,
    since_ms: int | None = None,
    run_id: str | None = None,
) -> Gathered:
    """Every pipeline run (of ``experiment``, of ``team``, started at or after ``since_ms``; or the one
    ``run_id``) with its attempts.

    ``team`` must be a valid team name (the spec's rules): it goes into an MLflow filter.
    """
    got = Gathered()
    found = [_pipeline(c, run_id)] if run_id is not None else _pipelines(c, experiment, team, since_ms)
    for p in found:
        rid, tags = p.info.run_id, p.data.tags
        spec_dict = _download_json(c, rid, SPEC_ARTIFACT)
        if spec_dict is None:
            got.skipped.append(f"{rid}: no {SPEC_ARTIFACT}")
            continue
        spec: RunSpec = parse_spec(spec_dict)
        attempts: list[Attempt] = []
        estimates: dict[str, float] = {}
        profiles: dict[int, dict[str, float]] = {}
        for s in stage_runs(c, rid):
            stage = s.data.tags.get("traingate.stage", "")
            if stage == "unit":
                continue  # pytest on the orchestrator's host: no pool slots are taken
            result = _download_json(c, s.info.run_id, RESULT_ARTIFACT)
            if result is None:
                got.skipped.append(f"{rid}/{stage}: no {RESULT_ARTIFACT} (still running, or its orchestrator died)")
                continue
            attempts += stage_attempts(rid, stage, spec, result)
            profile = (result.get("details") or {}).get("profile") or {}
            if profile.get("samples_per_s"):
                nodes, nproc = stage_world(spec, stage)
                profiles[nodes * nproc] = profile
            if result.get("estimated_cost_usd") is not None:
                estimates[stage] = float(result["estimated_cost_usd"])
        got.runs.append(
            Run(
                rid,
                tags.get("traingate.experiment", spec.identity.experiment),
                tags.get("traingate.team", spec.identity.team),
                tags.get("traingate.outcome") == "passed",
                tuple(attempts),
                estimates,
                profiles,
                spec.pool.price_per_gpu_hour,
            )
        )
    return got


def sweep_spend_usd(c: MlflowClient, sweep_run_id: str) -> float:
    """What a sweep's trials spent: the ``trial.cost_usd`` each trial run recorded when it ended."""
    exp = c.get_run(sweep_run_id).info.experiment_id
    total, token = 0.0, None
    while True:
        page = c.search_runs([exp], f"tags.mlflow.parentRunId = '{sweep_run_id}'", max_results=1000, page_token=token)
        total += sum(r.data.metrics.get("trial.cost_usd", 0.0) for r in page)
        token = page.token
        if not token:
            return total


def budgets_for(
    c: MlflowClient,
    spec: RunSpec,
    run_id: str,
    now: float,
    team_budgets: Mapping[str, TeamBudget] | None = None,
    sweep_run_id: str | None = None,
    pending: Sequence[Attempt] = (),
) -> list[BudgetLeft]:
    """:func:`traingate.cost.budget.budget_left` for a stage of ``run_id`` (a pipeline run id) from what
    the tracking store holds: the team's recorded runs, and, for a sweep trial, the sweep run's trials.
    ``team_budgets``: the pools config's (``CapacityConfig.team_budgets``), None when there is none.
    ``pending``: attempts of ``run_id`` not recorded yet (the stage a gate is deciding after:
    ``[Attempt.from_record(run_id, r) for r in result.attempts]``)."""
    team = spec.identity.team
    wanted = spec.budget.max_run_usd is not None or team in (team_budgets or {})
    recorded = gather(c, team=team).runs if wanted else []
    if pending:
        recorded.append(Run(run_id, spec.identity.experiment, team, False, tuple(pending)))
    sw = spec.sweep
    return budget_left(
        run_id=run_id,
        team=team,
        runs=recorded,
        now=now,
        max_run_usd=spec.budget.max_run_usd,
        team_budgets=team_budgets,
        sweep=sweep_run_id,
        max_sweep_usd=sw.budget.max_cost_usd if sw is not None and sweep_run_id else None,
        sweep_spent_usd=sweep_spend_usd(c, sweep_run_id) if sweep_run_id else 0.0,
    )
