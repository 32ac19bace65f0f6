"""benchmarks/campaign/figures.py: the headline figures derived from rows."""

from __future__ import annotations

import json

import pytest

from benchmarks.campaign import figures
from tests.benchmarks.fixtures import gpu_result


def test_fused_speedup_and_best_tiles_skip_wrong_and_failed_candidates():
    rows = gpu_result()["attention"]
    rows.append({**rows[2], "impl": "diff triton fast-but-wrong", "fwd_bwd_ms": 0.5, "correct": False})
    best = figures.best_triton(rows, 4096, 128)
    assert best["impl"] == "diff triton f64x16s2w4 kv16x128 q128x16 w8"
    assert figures.fused_speedup(rows, 4096, 128) == pytest.approx(6.5 / 4.8)
    assert figures.fused_speedup(rows, 2048, 128) is None


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


def test_tuned_tiles_come_from_the_newest_file_of_the_same_gpu(tmp_path):
    old, new = gpu_result("2026-12-01T00:00:00+00:00"), gpu_result("2026-12-05T00:00:00+00:00")
    new["triton_best"] = {"label": "newer", "head_dim": 128, "config": {}}
    other = gpu_result("2026-12-09T00:00:00+00:00")
    other["device"], other["triton_best"] = "NVIDIA H200", {"label": "h200", "head_dim": 128, "config": {}}
    for name, r in (("a.json", old), ("b.json", new), ("c.json", other)):
        (tmp_path / name).write_text(json.dumps(r))
    assert figures.kept_triton_best(tmp_path, "NVIDIA H100 80GB HBM3")["label"] == "newer"
    assert figures.kept_triton_best(tmp_path, "NVIDIA A100") is None


def test_headlines_come_from_the_rows_a_killed_phase_kept():
    """What a phase killed at its budget leaves: rows and candidate checks, no figures; the parent derives
    them (the fastest correct candidate's tiles, the speedup, the ratio and its bound)."""
    kept = gpu_result()
    result = {key: kept[key] for key in ("attention", "triton_candidates", "train")}
    result["triton_candidates"][0]["config"] = {"block_m": 64}
    result["train"] = [
        {**row, "flops_per_token": f} for row, f in zip(kept["train"], (9.0, 10.0), strict=True)
    ] + [{**kept["train"][1], "tokens_per_s": 99999.0, "variant": "dist-opt", "flops_per_token": 10.0}]
    figures_now = figures.headlines(result, head_dim=128)
    assert figures_now["fused_speedup_vs_best_unfused_4k"] == pytest.approx(6.5 / 4.8)
    assert figures_now["triton_best"] == {
        "label": "f64x16s2w4 kv16x128 q128x16 w8",
        "head_dim": 128,
        "config": {"block_m": 64},
    }
    assert figures_now["diff_vs_transformer_ratio_4k"] == pytest.approx(48211.0 / 51234.0)  # not the variant
    assert figures_now["flop_bound_4k"] == pytest.approx(0.9)
    assert figures_now["diff_vs_transformer_ratio_2k"] is None
    assert figures_now["flop_bound_3b_4k"] == pytest.approx(0.956, abs=5e-4)
    assert figures.headlines({"attention": [], "train": []}, 128) == {}
