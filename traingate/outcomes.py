"""Turn what a finished process left behind into a StageResult. Plain functions of files and numbers."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from traingate import sizing
from traingate.job.world import stage_world
from traingate.proc import ProcResult
from traingate.recipes.script import extract_metrics, summarize
from traingate.spec import RunSpec
from traingate.supervision import causes
from traingate.supervision.heartbeat import read_last_words
from traingate.stage import StageResult

NEXT = {"unit": "smoke", "smoke": "canary", "canary": "full"}


def classify_exit(proc: ProcResult, stage_dir: Path) -> tuple[str, str | None]:
    """(status, error) for a process that did not complete: ``failed``, ``diverged`` or ``preempted``,
    and ``"<cause>: <detail>"`` with a cause from :mod:`traingate.supervision.causes`."""
    result_path = stage_dir / "result.json"
    try:
        result_status = json.loads(result_path.read_text()).get("status") if result_path.exists() else None
    except ValueError:
        result_status = None
    verdict = causes.classify(causes.Evidence(
        returncode=proc.returncode, result_status=result_status, last_words=read_last_words(stage_dir),
        log_tail=proc.tail, stop_requested=proc.stopped, timed_out=proc.timed_out))
    if verdict.completed:
        return "completed", None
    status = {causes.DIVERGED: "diverged", causes.PREEMPTED: "preempted"}.get(verdict.cause or "", "failed")
    return status, f"{verdict.cause}: {verdict.detail}"


def _cost(spec: RunSpec, stage: str, duration_s: float) -> float:
    nodes, nproc = stage_world(spec, stage)
    return sizing.cost_usd(duration_s, sizing.slots(nodes * nproc), spec.pool.price_per_gpu_hour)


def _estimate_next(spec: RunSpec, stage: str, profile: dict[str, float]) -> dict[str, float]:
    nxt = NEXT.get(stage)
    if nxt is None or not profile.get("step_time_mean_s"):
        return {}
    nodes, nproc = stage_world(spec, nxt)
    est = sizing.estimate_stage(profile, getattr(spec.stages, nxt).max_steps, sizing.slots(nodes * nproc),
                                spec.pool.price_per_gpu_hour)
    return {"next_stage_wall_s": est["wall_s"], "next_stage_cost_usd": est["cost_usd"],
            "next_stage_slot_hours": est["slot_hours"]}


def from_runtime(spec: RunSpec, stage: str, proc: ProcResult, stage_dir: Path, duration_s: float) -> StageResult:
    """A built-in recipe's stage: the runtime's result.json plus how the process ended."""
    result_path = stage_dir / "result.json"
    data = json.loads(result_path.read_text()) if result_path.exists() else None
    if proc.returncode == 0 and data is not None and data["status"] == "completed":
        status, error = "completed", None
    else:
        status, error = classify_exit(proc, stage_dir)
        if data is not None and data["status"] in ("diverged", "preempted"):
            status = data["status"]
    metrics: dict[str, Any] = dict(data["metrics"]) if data else {}
    profile = metrics.pop("profile", {}) or {}
    evals = metrics.pop("eval", {}) or {}
    for k in ("step_time_mean_s", "step_time_p50_s", "step_time_p90_s", "step_time_p99_s", "samples_per_s", "tokens_per_s", "peak_memory_mb",
              "startup_s", "data_wait_fraction"):
        if k in profile:
            metrics[k] = profile[k]
    return StageResult(
        stage=stage, status=status, metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        cost_usd=_cost(spec, stage, duration_s), duration_s=duration_s,
        checkpoint_uri=data.get("checkpoint_uri") if data else None,
        estimate=_estimate_next(spec, stage, profile) if status == "completed" else {},
        details={"profile": profile, "eval": evals, "log_tail": proc.tail[-50:],
                 "checkpoint_blocked_s": data.get("checkpoint_blocked_s") if data else None},
        error=error)


def from_script(spec: RunSpec, stage: str, proc: ProcResult, stage_dir: Path, log_text: str,
                cmd: list[str]) -> StageResult:
    """A script's stage: its exit code, and the metrics its output shows."""
    s = spec.recipe.script
    assert s is not None
    series = extract_metrics(log_text, s.metrics)
    metrics = summarize(series) if series else {"nonfinite_steps": 0.0}
    status, error = ("completed", None) if proc.returncode == 0 else classify_exit(proc, stage_dir)
    estimate: dict[str, float] = {}
    steps = metrics.get("steps", 0)
    if status == "completed" and steps > 0:
        estimate = _estimate_next(spec, stage, {"step_time_mean_s": proc.duration_s / steps})
    return StageResult(stage=stage, status=status, metrics=metrics, cost_usd=_cost(spec, stage, proc.duration_s),
                       duration_s=proc.duration_s, checkpoint_uri=None, estimate=estimate,
                       details={"command": cmd, "series": {k: v[-200:] for k, v in series.items()},
                                "log_tail": proc.tail[-50:]}, error=error)


def from_pytest(proc: ProcResult, junit_path: Path, duration_s: float) -> StageResult:
    """The unit stage: counts from pytest's JUnit XML."""
    passed = failed = skipped = 0
    failures: list[str] = []
    if junit_path.exists():
        root = ET.parse(junit_path).getroot()
        for case in root.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                failed += 1
                failures.append(f"{case.get('name')}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}")
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
    # pytest: 0 all passed, 1 some failed, 5 none collected; anything else means it could not run.
    ran = proc.returncode in (0, 1, 5)
    status = "completed" if ran else "failed"
    error = None if ran else f"pytest exit code {proc.returncode}: {' | '.join(proc.tail[-3:])}"
    return StageResult(stage="unit", status=status,
                       metrics={"tests_passed": passed, "tests_failed": failed, "tests_skipped": skipped},
                       duration_s=duration_s, details={"failures": failures, "log_tail": proc.tail[-50:]},
                       error=error)
