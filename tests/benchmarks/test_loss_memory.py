"""benchmarks/loss_memory.py at a small shape: both losses agree, and the memory plan's chunked-loss term
(diffmeg.training.memory.loss_peak_bytes) is what the operating system measures."""

from __future__ import annotations

import pytest

from benchmarks.loss_memory import main


def test_chunked_loss_peak_is_measured_and_planned():
    rows = main(["--tokens", "2048", "--vocab-size", "32768", "--hidden-size", "64", "--chunk-size", "256"])[
        "rows"
    ]
    whole, chunked = rows
    assert chunked["loss_sum"] == pytest.approx(whole["loss_sum"], rel=1e-5)
    assert chunked["peak_mib"] < whole["peak_mib"] / 4  # 1/8 of the sequence per chunk
    assert chunked["peak_mib"] == pytest.approx(chunked["planned_mib"], rel=0.15)
