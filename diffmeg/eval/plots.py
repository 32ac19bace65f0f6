"""Heatmaps for the analysis tools (line plots reuse diffmeg.eval.plotting), drawn on an
explicit Agg canvas like the evaluation plots, so no global matplotlib state is touched."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from diffmeg.eval.plotting import require_matplotlib


def plot_heatmaps(
    grids: Sequence[tuple[str, np.ndarray]],
    path: str,
    *,
    xticks: Sequence[str],
    yticks: Sequence[str],
    xlabel: str,
    ylabel: str,
    title: str,
    vmin: float = 0.0,
    vmax: float = 1.0,
) -> None:
    """One annotated heatmap per (label, [rows, cols] values), side by side, written atomically."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.0 + 3.2 * len(grids), 3.6), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(grids), squeeze=False)[0]
    image = None
    for ax, (label, values) in zip(axes, grids, strict=True):
        image = ax.imshow(values, vmin=vmin, vmax=vmax, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(xticks)), labels=list(xticks))
        ax.set_yticks(range(len(yticks)), labels=list(yticks))
        for (i, j), v in np.ndenumerate(values):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel(ylabel)
    if image is not None:
        fig.colorbar(image, ax=list(axes))
    fig.suptitle(title)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
