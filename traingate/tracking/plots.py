"""PNG figures for a run: loss curve, throughput, confusion matrix (matplotlib, headless Agg backend)."""

from __future__ import annotations

from typing import Any


def _figure(title: str) -> tuple[Any, Any]:
    # lazy: matplotlib takes a second to import; only a stage's end draws (its Figure needs no display)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.add_subplot()
    ax.set_title(title)
    return fig, ax


def curves(series: dict[str, list[tuple[int, float]]], ylabel: str, title: str) -> Any:
    """One line per metric over steps."""
    fig, ax = _figure(title)
    for name, points in series.items():
        points = sorted(points)
        ax.plot([s for s, _ in points], [v for _, v in points], label=name, marker="." if len(points) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


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
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig
