"""The evaluation tools' figures (line plots, annotated heatmaps), written straight to PNG files.

matplotlib is optional (not needed for training), so it is imported on first use and its absence is
one clear error. Figures are drawn on an explicit Agg canvas rather than through pyplot: nothing
touches matplotlib's global backend, so a tool called from a notebook or a headless node behaves
the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from diffmeg.errors import DiffmegError
from diffmeg.storage import atomic_write


@dataclass
class Curve:
    """One labelled line: y against x (same length)."""

    label: str
    x: np.ndarray
    y: np.ndarray


def count_label(value: float) -> str:
    """Tick text for a token count: 512, 1K, 64K, 1M (powers of two read better than 2^16)."""
    n = round(value)
    if n <= 0 or abs(value - n) > 1e-6 * max(1.0, abs(value)):
        return f"{value:g}"
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def require_matplotlib() -> None:
    """Fail before any long computation when the plot could not be written at its end."""
    try:
        import matplotlib  # noqa: F401 - optional dependency, checked before a long computation
    except ImportError:
        raise DiffmegError(
            "matplotlib is not installed: pip install matplotlib (or pass --no-plot for the CSV only)"
        ) from None


def plot_curves(
    curves: Sequence[Curve],
    path: str,
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    logx: bool = False,
    vlines: Sequence[tuple[float, str]] = (),
) -> None:
    """Write `curves` on one set of axes to the PNG `path` (atomically: a crash leaves no half file).

    `vlines` are labelled dashed vertical markers, e.g. where extrapolation beyond training starts.
    """
    fig = figure((7.0, 4.5))
    ax = fig.add_subplot()
    for curve in curves:
        ax.plot(np.asarray(curve.x), np.asarray(curve.y), label=curve.label, linewidth=1.6)
    for x, label in vlines:
        ax.axvline(x, color="0.45", linestyle="--", linewidth=1.0, label=label)
    if logx:
        from matplotlib.ticker import FuncFormatter  # optional dependency

        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: count_label(v)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="major", alpha=0.35)
    if len(curves) > 1 or vlines or (curves and curves[0].label):
        ax.legend()
    save_png(fig, path)


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
    fig = figure((1.0 + 3.2 * len(grids), 3.6))
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
    save_png(fig, path)


def figure(size: tuple[float, float]):
    """A matplotlib Figure on its own Agg canvas (no pyplot, no global backend)."""
    require_matplotlib()
    # optional dependency (require_matplotlib above names the fix)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str, dpi: float | None = None) -> None:
    """Write the PNG atomically: a crash leaves no half-written file, and an earlier plot of the same name
    stays whole until the new one is complete. `dpi`: the figure's own when None."""
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi if dpi is not None else "figure")
