"""The PNGs traingate writes are the ones MLflow does not draw, and they read without a legend hunt: a
distinct colour per series, units on the axes, ratios on log axes.

A stage's record on the session's MLflow store (sqlite) and the simulator's figures of a real replay."""

from __future__ import annotations

from uuid import uuid4

from matplotlib.colors import to_hex

from traingate.capacity.jobs import Job
from traingate.capacity.policy import Policy
from traingate.capacity.pools import parse_config
from traingate.capacity.report import plot_figures
from traingate.capacity.simulate import TraceJob, simulate
from traingate.capacity.trace import TraceParams, generate
from traingate.job.result import StageResult, Status
from traingate.settings import Settings
from traingate.tracking import runs

CFG = parse_config({
    "pools": {"p": {"gpus_per_node": 4, "nodes": 2, "price_per_gpu_hour": 2.0, "worker": "docker"}},
    "quotas": {"vision": {"p": 4}, "speech": {"p": 4}},
    "simulator": {"checkpoint_every_s": 600, "restart_cost_s": 60, "preempt_grace_s": 10},
})
POLICIES = ("fifo", "fairshare", "fairshare+backfill", "fairshare+backfill+preempt")


def test_a_stage_record_writes_only_the_confusion_matrix_png_its_curves_are_mlflow_metrics(tmp_path):
    c = runs.client(Settings.from_env().tracking_uri)  # the session's store: its schema is created once
    experiment = c.create_experiment(f"plots-{uuid4().hex[:8]}", artifact_location=(tmp_path / "art").as_uri())
    run = c.create_run(experiment, tags={"traingate.stage": "canary"})
    series = {"train_loss": [[s, 2.0 / (s + 1)] for s in range(0, 40, 5)],
              "samples_per_s": [[s, 900.0 + s] for s in range(0, 40, 5)]}
    confusion = [[5, 1], [0, 6]]
    result = StageResult("canary", Status.COMPLETED, metrics={"steps": 35, "val_loss": 0.2},
                         details={"series": series, "eval": {"confusion": confusion}})
    runs.record_stage(c, run.info.run_id, result, None)

    def pngs(path: str = "") -> list[str]:
        out = []
        for a in c.list_artifacts(run.info.run_id, path):
            out += pngs(a.path) if a.is_dir else [a.path] if a.path.endswith(".png") else []
        return out

    assert pngs() == ["eval/confusion.png"]
    # What a loss or throughput PNG would have drawn is in MLflow's metric history, step by step.
    assert [m.step for m in c.get_metric_history(run.info.run_id, "train_loss")] == list(range(0, 40, 5))
    assert [m.step for m in c.get_metric_history(run.info.run_id, "samples_per_s")] == list(range(0, 40, 5))


def _series_colours(ax) -> list[str]:
    """The colour of each labelled series of an axes: its lines, or its bar groups."""
    lines = [to_hex(line.get_color()) for line in ax.get_lines() if not line.get_label().startswith("_")]
    bars = [to_hex(bc.patches[0].get_facecolor()) for bc in ax.containers if bc.get_label() and bc.patches]
    return lines + bars


def test_the_simulator_figures_give_each_series_its_own_colour_units_on_axes_and_ratios_on_a_log_axis():
    rows = generate(TraceParams(n_jobs=60, capacity=8, gpus_per_node=4, load=0.9, seed=3,
                                classes=(("production", 0.4), ("research", 0.6)),
                                small_median_s=600, large_median_s=3600))
    trace = [TraceJob(Job(r["job_id"], r["team"], r["priority"], "p", r["gpus"], r["submit_s"],
                          checkpoint_every_s=600.0), r["duration_s"]) for r in rows]
    results = [simulate(trace, CFG, Policy.parse(name)) for name in POLICIES]
    figs = plot_figures(results)
    assert list(figs) == ["wait_cdf.png", "ratios.png", "team_share.png", "timeseries.png"]

    (cdf,) = figs["wait_cdf.png"].axes
    assert len(set(_series_colours(cdf))) == len(POLICIES) and cdf.get_xscale() == "log"
    (ratios,) = figs["ratios.png"].axes
    assert ratios.get_yscale() == "log" and "(x, log)" in ratios.get_ylabel()
    assert [bc.get_label() for bc in ratios.containers] == ["mean wait", "mean JCT"]
    assert len(set(_series_colours(ratios))) == 2
    (share,) = figs["team_share.png"].axes
    teams = {r["team"] for r in rows}
    assert len(teams) >= 2 and len(set(_series_colours(share))) == len(teams)
    for ax in figs["timeseries.png"].axes:
        assert len(set(_series_colours(ax))) == len(POLICIES), ax.get_title()
    for name, fig in figs.items():
        for ax in fig.axes:  # a unit in parentheses on every labelled axis
            labels = [label for label in (ax.get_xlabel(), ax.get_ylabel()) if label]
            assert labels and all("(" in label and ")" in label for label in labels), (name, labels)
