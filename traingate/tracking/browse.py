"""Reading runs back from MLflow for the terminal: `traingate runs` and `traingate show`.

Plain functions from an MlflowClient to text, so the CLI stays thin and tests read the same output.
"""

from __future__ import annotations

import time
from typing import Any

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from traingate.spec import STAGES
from traingate.tracking.runs import notes, restart_count, restarts, run_cost_usd, stage_runs
from traingate.units import UTC_LABEL, duration, usd, utc

_HEADLINE = (
    "val_accuracy",
    "val_loss",
    "val_bits_per_char",
    "final_loss",
    "loss_decrease_fraction",
    "samples_per_s",
    "tests_passed",
)


def _all_runs(c: MlflowClient, experiment: str | None) -> list[Run]:
    if experiment:
        exp = c.get_experiment_by_name(experiment)
        if exp is None:
            raise ValueError(f"no experiment {experiment!r}; `traingate runs` without --experiment lists all")
        ids = [exp.experiment_id]
    else:
        ids = [e.experiment_id for e in c.search_experiments()]
    out: list[Run] = []
    token = None
    while True:
        page = c.search_runs(ids, "tags.`traingate.kind` != ''", max_results=1000, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def _metric(stages: list[Run], key: str) -> float | None:
    """A metric of a pipeline: from its deepest stage that has it (``val_accuracy`` or ``stage.val_accuracy``)."""
    for r in reversed(stages):
        for k in (key, f"stage.{key}"):
            if k in r.data.metrics:
                return r.data.metrics[k]
    return None


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000.0


def list_runs(
    c: MlflowClient,
    experiment: str | None = None,
    team: str | None = None,
    sort: str | None = None,
    ascending: bool = False,
    limit: int = 50,
    now: float | None = None,
) -> list[dict[str, Any]]:
    """Pipeline runs, newest first (or by a metric of their deepest stage), with their stages' totals, when each
    started and how long it ran (to its end, or to ``now`` while it runs)."""
    now = time.time() if now is None else now
    runs = _all_runs(c, experiment)
    children: dict[str, list[Run]] = {}
    for r in runs:
        if r.data.tags.get("traingate.kind") == "stage":
            children.setdefault(r.data.tags.get("mlflow.parentRunId", ""), []).append(r)
    rows = []

    order = {s: i for i, s in enumerate(STAGES)}
    for r in runs:
        t = r.data.tags
        if t.get("traingate.kind") != "pipeline" or (team and t.get("traingate.team") != team):
            continue
        stages = sorted(
            children.get(r.info.run_id, []), key=lambda s: order.get(s.data.tags.get("traingate.stage", ""), 9)
        )
        rows.append(
            {
                "run_id": r.info.run_id,
                "name": r.info.run_name,
                "experiment": t.get("traingate.experiment", ""),
                "team": t.get("traingate.team", ""),
                "owner": t.get("traingate.owner", ""),
                "status": r.info.status,
                "reached": stages[-1].data.tags.get("traingate.stage", "") if stages else "",
                "restarts": sum(restart_count(s) for s in stages),
                "cost_usd": run_cost_usd(stages),
                "valid": t.get("traingate.identity_valid", "false"),
                "start_time": r.info.start_time,
                "duration_s": _duration_s(r, now),
                "metric": _metric(stages, sort) if sort else None,
            }
        )
    if sort:
        known = [x for x in rows if x["metric"] is not None]
        rows = sorted(known, key=lambda x: x["metric"], reverse=not ascending) + [
            x for x in rows if x["metric"] is None
        ]
    else:
        rows.sort(key=lambda x: x["start_time"], reverse=True)
    return rows[:limit]


def _duration_s(r: Run, now: float) -> float | None:
    """Start to end; a run still RUNNING (no end time) counts up to ``now``."""
    start = _seconds(r.info.start_time)
    if start is None:
        return None
    end = _seconds(r.info.end_time) if r.info.status != "RUNNING" else None
    return max(0.0, (end if end is not None else now) - start)


def render_runs(rows: list[dict[str, Any]], sort: str | None) -> str:
    head = [
        "RUN ID",
        "NAME",
        "EXPERIMENT",
        "TEAM",
        "OWNER",
        "STATUS",
        f"START ({UTC_LABEL})",
        "DURATION",
        "REACHED",
        "RESTARTS",
        "COST",
        "VALID",
    ]
    if sort:
        head.append(sort.upper())
    table = [head]
    for x in rows:
        line = [
            x["run_id"],
            x["name"],
            x["experiment"],
            x["team"],
            x["owner"],
            x["status"],
            utc(_seconds(x["start_time"])),
            duration(x["duration_s"]),
            x["reached"],
            str(x["restarts"]),
            usd(x["cost_usd"]),
            x["valid"],
        ]
        if sort:
            line.append("-" if x["metric"] is None else f"{x['metric']:.6g}")
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table) + "\n"


def show_run(c: MlflowClient, run_id: str) -> str:
    """Identity, stages with gates and restarts, notes and cost of a pipeline run (or of a stage's pipeline)."""
    run = c.get_run(run_id)
    t = run.data.tags
    if t.get("traingate.kind") == "stage" and t.get("mlflow.parentRunId"):
        stage_note = f"(stage run {run_id} of pipeline run {t['mlflow.parentRunId']})"
        run = c.get_run(t["mlflow.parentRunId"])
        t = run.data.tags
    else:
        stage_note = ""
    exp = c.get_experiment(run.info.experiment_id)
    lines = [
        f"run {run.info.run_id}  {run.info.run_name}  [{run.info.status}]" + (f"  {stage_note}" if stage_note else ""),
        "",
        "identity:",
    ]
    if t.get("traingate.outcome") == "stopped" and t.get("traingate.stop_reason"):
        # Who stopped or paused the run and why (a gate, an alert, a budget, a full disk), with its fix.
        reason = t["traingate.stop_reason"].splitlines()[0]
        lines[1:1] = [f"stopped in {t.get('traingate.reached_stage', '?')}: {reason}"]
    dirty = t.get("traingate.code_dirty") == "true"
    for label, value in [
        ("experiment", exp.name),
        ("owner", t.get("traingate.owner")),
        ("team", t.get("traingate.team")),
        ("purpose", t.get("traingate.purpose")),
        ("recipe", t.get("traingate.recipe")),
        (
            "code",
            f"{t.get('traingate.code_version')}"
            + (f" (dirty, diff {t.get('traingate.code_diff_hash')})" if dirty else ""),
        ),
        ("data", f"{t.get('traingate.data_snapshot')}  {t.get('traingate.data_uri')}"),
        ("spec hash", t.get("traingate.spec_hash")),
        ("work pool", t.get("traingate.work_pool")),
        (
            "valid",
            t.get("traingate.identity_valid", "false")
            + (f"  missing: {t['traingate.identity_missing']}" if t.get("traingate.identity_missing") else ""),
        ),
    ]:
        lines.append(f"  {label:<10} {value}")
    stages = stage_runs(c, run.info.run_id)
    lines += ["", "stages:"]
    for s in stages:
        st, m = s.data.tags, s.data.metrics
        cost = m.get("stage.cost_usd", 0.0)
        gate = {"true": "passed", "false": "FAILED"}.get(st.get("traingate.gate_passed", ""), "-")
        lines.append(
            f"  {st.get('traingate.stage', '?'):<7} {st.get('traingate.stage_status', s.info.status):<10} "
            f"gate {gate:<7} {m.get('stage.duration_s', 0.0):7.1f} s  {usd(cost)}  run {s.info.run_id}"
        )
        if st.get("traingate.gate_reasons"):
            lines.append(f"          gate: {st['traingate.gate_reasons']}")
        headline = [f"{k}={m[k]:.4g}" for k in _HEADLINE if k in m]
        if headline:
            lines.append(f"          {'  '.join(headline)}")
        if st.get("traingate.checkpoint.latest_uri") or st.get("traingate.checkpoint_uri"):
            lines.append(
                f"          checkpoint {st.get('traingate.checkpoint.latest_uri') or st['traingate.checkpoint_uri']}"
            )
        for r in restarts(s):
            lost = [f"{r[k]}{unit}" for k, unit in (("steps_lost", " steps"), ("time_lost_s", " s")) if k in r]
            lines.append(
                f"          restart {r['n']}: cause {r.get('cause', '?')}, resumed from step "
                f"{r.get('resumed_from_step') or '?'}"
                + (f", {' and '.join(lost)} lost" if lost else "")
                + (f", {r['downtime_s']} s down" if "downtime_s" in r else "")
            )
        if st.get("traingate.promotion"):
            lines.append(f"          promotion: {st['traingate.promotion']}")
    if not stages:
        lines.append("  (none)")
    lines += ["", f"cost: {usd(run_cost_usd(stages))}", "", "notes:"]
    logbook = notes(run) + [n for s in stages for n in notes(s)]
    lines += [f"  {n['time']}  {n['author']}: {n['text']}" for n in sorted(logbook, key=lambda n: n["time"])] or [
        "  (none)"
    ]
    return "\n".join(lines) + "\n"
