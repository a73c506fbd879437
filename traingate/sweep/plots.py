"""Optuna's visualisations that MLflow does not draw, as PNG files: optimisation history (best so far), parameter
importance, and the Pareto front of a multi-objective study.

Each trial's intermediate values are its MLflow run's step metrics (``reported.<metric>``); MLflow's compare
view draws those curves, so no PNG repeats them.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import matplotlib
from optuna.visualization import matplotlib as ovm

matplotlib.use("Agg")  # files only; sweeps run on headless workers and in threads

import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402


def save_plots(study: optuna.Study, out_dir: Path, metrics: list[str]) -> list[Path]:
    """Write the plots that the study's trials support; ``metrics``: each objective's metric name, the axis
    labels. Returns their paths."""

    out_dir.mkdir(parents=True, exist_ok=True)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    multi = len(study.directions) > 1
    plots = {}
    if complete:
        if multi:
            plots["pareto_front"] = lambda: ovm.plot_pareto_front(study, target_names=metrics)
            plots["optimization_history"] = lambda: ovm.plot_optimization_history(
                study, target=lambda t: t.values[0], target_name=metrics[0]
            )
        else:
            plots["optimization_history"] = lambda: ovm.plot_optimization_history(study, target_name=metrics[0])
    if len(complete) >= 2 and len({tuple(sorted(t.params.items(), key=str)) for t in complete}) >= 2:
        plots["param_importances"] = (
            (lambda: ovm.plot_param_importances(study, target=lambda t: t.values[0], target_name=metrics[0]))
            if multi
            else (lambda: ovm.plot_param_importances(study, target_name=metrics[0]))
        )
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for name, make in plots.items():
            ax: Any = make()  # an Axes, or an array of them
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            p = out_dir / f"{name}.png"
            fig.savefig(p, dpi=90, bbox_inches="tight")
            plt.close(fig)
            paths.append(p)
    return paths
