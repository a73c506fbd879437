"""The ladder's plan: which stages run, with what limits, at what cost ceiling. Nothing runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from traingate.job import sizing
from traingate.job.files import read_supervisor_state
from traingate.job.stagejob import stage_timeout_s
from traingate.job.vocab import Status
from traingate.job.world import stage_world
from traingate.settings import Settings
from traingate.spec import STAGES, RunSpec, SpecError, load_spec


def stages_until(until: str) -> list[str]:
    return list(STAGES[: STAGES.index(until) + 1])


def plan(
    spec: RunSpec, samples: dict[str, int], until: str = "full", profile: dict[str, float] | None = None
) -> list[dict[str, object]]:
    """One row per stage. ``profile`` (a previous canary's) turns ceilings into estimates."""
    rows: list[dict[str, object]] = []
    price = spec.pool.price_per_gpu_hour
    for stage in stages_until(until):
        gate = spec.gate(stage)
        row: dict[str, object] = {
            "stage": stage,
            "gate": "; ".join(f"{r.metric} {r.op} {r.value:g}" for r in gate.rules)
            + ("; human approval" if gate.require_approval else ""),
        }
        if stage == "unit":
            row.update(processes=1, steps="-", samples="-", cost_ceiling_usd=0.0)
        else:
            nodes, nproc = stage_world(spec, stage)
            row.update(
                processes=nodes * nproc,
                steps=getattr(spec.stages, stage).max_steps,
                samples=samples.get(stage, "-"),
                # the longest the stage may run: its StageJob's timeout (a script's own timeout when lower)
                cost_ceiling_usd=sizing.cost_usd(stage_timeout_s(spec, stage), sizing.slots(nodes * nproc), price),
            )
            est = sizing.estimate_of(spec, stage, profile) if profile else None
            if est is not None:
                row.update(est_wall_s=est["wall_s"], est_cost_usd=est["cost_usd"])
        rows.append(row)
    return rows


def render(rows: list[dict[str, object]], spec: RunSpec) -> str:
    head = (
        f"plan for {spec.identity.experiment!r} ({spec.recipe.name}), pool {spec.resources.work_pool} "
        f"at ${spec.pool.price_per_gpu_hour:g}/slot-hour"
        + (f", budget ${spec.budget.max_cost_usd:g}" if spec.budget.max_cost_usd is not None else "")
    )
    lines = [
        head,
        "(ceiling: the stage's timeout at full price; estimate: from a previous canary's step times)",
        f"{'stage':<7} {'procs':>5} {'steps':>6} {'samples':>8} {'ceiling $':>10} {'est. $':>9}  gate",
    ]
    for r in rows:
        est = r.get("est_cost_usd")
        lines.append(
            f"{r['stage']:<7} {r['processes']:>5} {r['steps']!s:>6} {r['samples']!s:>8} "
            f"{r['cost_ceiling_usd']:>10.4f} {f'{est:.4f}' if est is not None else 'n/a':>9}  "
            f"{r['gate']}"
        )
    return "\n".join(lines)


@dataclass
class ResumePoint:
    """Where an interrupted run continues: its spec, the stage to resume and the ones after it."""

    run_id: str
    spec: RunSpec
    stage: str
    remaining: list[str]
    mlflow_run_ids: dict[str, str] = field(default_factory=dict)  # stage -> its MLflow run, to write on into


def resume_point(settings: Settings, run_id: str, stage: str | None = None) -> ResumePoint:
    """The first stage of run ``run_id`` that did not complete (or ``stage``), from its stage directories."""

    runs = settings.state_dir / "runs"
    run_dir = runs / run_id
    if not run_id or "/" in run_id or not (run_dir / "spec.yaml").is_file():
        raise SpecError(
            f"resume_from.run_id = {run_id!r}: no such run under {runs}; pass the run id "
            "`traingate run` printed (and the same TRAINGATE_STATE_DIR)"
        )
    spec = load_spec(run_dir / "spec.yaml")
    states = {s: read_supervisor_state(run_dir / s) for s in STAGES if s != "unit"}
    ids = {s: st.job["mlflow_run_id"] for s, st in states.items() if st is not None and st.job.get("mlflow_run_id")}
    if stage is None:
        # The ladder goes past unit only on a passed unit gate: a later stage that started says so too (a
        # script with no recipe.script.tests passes unit without a junit.xml).
        done = {"unit"} if (run_dir / "unit" / "junit.xml").exists() or any(states.values()) else set()
        done |= {s for s, st in states.items() if st is not None and st.final_status == Status.COMPLETED}
        stage = next((s for s in STAGES if s not in done), None)
        if stage is None:  # every stage ran; the orchestrator may have died before promoting and closing
            return ResumePoint(run_id, spec, "full", [], ids)
    return ResumePoint(run_id, spec, stage, list(STAGES[STAGES.index(stage) :]), ids)


FLOW_RUNS = "flow-runs"  # under the state dir: one file per ladder flow run, holding the run id it started


def record_flow_run(settings: Settings, flow_run_id: str, run_id: str) -> None:
    """Remember that flow run ``flow_run_id`` started run ``run_id`` (written whole, then renamed into place)."""
    d = settings.state_dir / FLOW_RUNS
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{flow_run_id}.tmp"
    tmp.write_text(run_id)
    tmp.replace(d / flow_run_id)


def run_of_flow_run(settings: Settings, flow_run_id: str) -> str | None:
    """The run flow run ``flow_run_id`` started, or None. Prefect's Retry runs a failed or crashed flow run
    again under its own id and parameters: this is how the ladder knows it has a run to continue.

    >>> import tempfile; s = Settings.from_env({"TRAINGATE_STATE_DIR": tempfile.mkdtemp()})
    >>> record_flow_run(s, "f1", "r1"); run_of_flow_run(s, "f1"), run_of_flow_run(s, "f2")
    ('r1', None)
    """
    p = settings.state_dir / FLOW_RUNS / flow_run_id
    return p.read_text().strip() or None if p.is_file() else None
