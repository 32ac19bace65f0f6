"""Line plots for the evaluation tools, written straight to PNG files.

matplotlib is optional (not needed for training), so it is imported on first use and its absence is
one clear error. Figures are drawn on an explicit Agg canvas rather than through pyplot: nothing
touches matplotlib's global backend, so a tool called from a notebook or a headless node behaves
the same.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from diffmeg.errors import DiffmegError


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
        import matplotlib  # noqa: F401
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
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for curve in curves:
        ax.plot(np.asarray(curve.x), np.asarray(curve.y), label=curve.label, linewidth=1.6)
    for x, label in vlines:
        ax.axvline(x, color="0.45", linestyle="--", linewidth=1.0, label=label)
    if logx:
        from matplotlib.ticker import FuncFormatter

        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: count_label(v)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="major", alpha=0.35)
    if len(curves) > 1 or vlines or (curves and curves[0].label):
        ax.legend()
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
