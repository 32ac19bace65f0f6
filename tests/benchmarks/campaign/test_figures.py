"""benchmarks/campaign/figures.py: the headline figures derived from rows."""

from __future__ import annotations

import pytest

from benchmarks.campaign import figures
from tests.benchmarks.fixtures import gpu_result


def test_throughput_ratio_uses_the_best_diff_backend():
    rows = [
        {"seq": 4096, "arch": "transformer", "tokens_per_s": 100.0, "flops_per_token": 9.0, "error": None},
        {"seq": 4096, "arch": "diff", "tokens_per_s": 90.0, "flops_per_token": 10.0, "error": None},
        {"seq": 4096, "arch": "diff", "tokens_per_s": 93.0, "flops_per_token": 10.0, "error": None},
        {"seq": 4096, "arch": "diff", "tokens_per_s": None, "flops_per_token": 10.0, "error": "OOM"},
        {"seq": 4096, "arch": "diff2", "tokens_per_s": 99.0, "flops_per_token": 11.0, "error": None},
    ]
    assert figures.throughput_ratio(rows, 4096) == (pytest.approx(0.93), pytest.approx(0.9))
    assert figures.throughput_ratio(rows, 2048) == (None, None)


def test_flop_bound_of_the_3b_presets_matches_the_design():
    assert figures.flop_bound("diff-3b", 4096) == pytest.approx(0.956, abs=5e-4)
    assert figures.flop_bound("diff-3b", 2048) == pytest.approx(0.976, abs=5e-4)


def test_headlines_come_from_the_rows_a_killed_phase_kept():
    """What a phase killed at its budget leaves: rows, no figures; the parent derives them (the ratio and
    its bound)."""
    kept = gpu_result()
    result = {
        "train": [{**row, "flops_per_token": f} for row, f in zip(kept["train"], (9.0, 10.0), strict=True)]
        + [{**kept["train"][1], "tokens_per_s": 99999.0, "variant": "dist-opt", "flops_per_token": 10.0}]
    }
    figures_now = figures.headlines(result)
    assert figures_now["diff_vs_transformer_ratio_4k"] == pytest.approx(48211.0 / 51234.0)  # not the variant
    assert figures_now["flop_bound_4k"] == pytest.approx(0.9)
    assert figures_now["diff_vs_transformer_ratio_2k"] is None
    assert figures_now["flop_bound_3b_4k"] == pytest.approx(0.956, abs=5e-4)
    assert figures.headlines({"attention": [], "train": []}) == {}
