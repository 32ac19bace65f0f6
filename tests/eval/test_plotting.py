"""diffmeg.eval.plotting: tick labels and atomically written PNGs (line plots, heatmaps)."""

from __future__ import annotations

import numpy as np
import pytest

from diffmeg.eval.plotting import Curve, count_label, plot_curves, plot_heatmaps, save_png


@pytest.mark.parametrize(
    "value,text", [(1, "1"), (512, "512"), (1024, "1K"), (65536, "64K"), (3072, "3K"), (1 << 20, "1M"),
                   (1500, "1500"), (0.5, "0.5")],
)  # fmt: skip
def test_count_labels_read_like_context_lengths(value, text):
    assert count_label(value) == text


def test_plot_writes_one_png_and_no_temporary_file(tmp_path):
    pytest.importorskip("matplotlib")
    x = np.arange(1, 65537)
    curves = [Curve("DIFF", x, 3 + 1 / np.sqrt(x)), Curve("Transformer", x, 3.1 + 1 / np.sqrt(x))]
    path = tmp_path / "p.png"
    plot_curves(curves, str(path), xlabel="x", ylabel="y", logx=True, vlines=[(4096, "trained length")])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["p.png"]


def test_heatmaps_write_one_png_and_no_temporary_file(tmp_path):
    pytest.importorskip("matplotlib")
    grids = [("DIFF", np.array([[1.0, 0.5], [0.25, 0.0]])), ("Transformer", np.zeros((2, 2)))]
    path = tmp_path / "h.png"
    plot_heatmaps(
        grids, str(path), xticks=["4K", "8K"], yticks=["0%", "100%"], xlabel="x", ylabel="y", title="t"
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["h.png"]


class _FailingFigure:
    """A figure whose save writes half a file and then fails, as a full disk or a killed process would."""

    def savefig(self, target, **_kwargs) -> None:
        target.write(b"\x89PNG half")  # save_png hands it the open temporary, as it does matplotlib
        raise OSError("No space left on device")


def test_a_failed_save_keeps_the_earlier_plot_whole_and_leaves_no_temporary(tmp_path):
    """toy_compare's and upcycle_results' plots go through save_png too: a rerun that fails mid-write
    leaves the earlier PNG as it was."""
    path = tmp_path / "mqar_accuracy.png"
    path.write_bytes(b"the earlier plot")
    with pytest.raises(OSError, match="No space"):
        save_png(_FailingFigure(), str(path), dpi=110)
    assert path.read_bytes() == b"the earlier plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mqar_accuracy.png"]
