"""PNG figures for a run that MLflow does not draw itself: the confusion matrix (matplotlib, headless Agg backend).

Curves of logged metrics (loss, throughput) are MLflow's own charts, drawn from the metric history."""

from __future__ import annotations

from typing import Any


def _figure(title: str) -> tuple[Any, Any]:
    # lazy: matplotlib takes a second to import; only a stage's end draws (its Figure needs no display)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.add_subplot()
    ax.set_title(title)
    return fig, ax


def confusion_matrix(matrix: list[list[int]]) -> Any:
    fig, ax = _figure("confusion matrix (rows: true, columns: predicted)")
    im = ax.imshow(matrix, cmap="Blues")
    n = len(matrix)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    for i, row in enumerate(matrix):
        for j, v in enumerate(row):
            if v:
                ax.text(j, i, str(v), ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="samples")
    fig.tight_layout()
    return fig
