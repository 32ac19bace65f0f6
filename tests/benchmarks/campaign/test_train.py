"""benchmarks/campaign/train.py: MFU on both denominators; the overlap rows differ by the overlap flags."""

from __future__ import annotations

import pytest

from benchmarks.campaign import train


def test_mfu_against_the_dense_peak_and_the_measured_matmul():
    r = {"backend": "triton", "layers": 8, "mbs": 1, "microbatches": 4, "tokens_per_s": 5e4, "tflops": 445.0,
         "flops_per_token": 8.9e9, "mem_gib": 40.0, "estimated_gib": 41.0,
         "resident_gib": 0.0, "left_gib": 0.0, "profile": None, "error": None}  # fmt: skip
    row = train.train_row(r, "cuda", peak=989.4, roof=795.0)
    assert row["mfu"] == pytest.approx(445.0 / 989.4) and row["mfu_vs_matmul"] == pytest.approx(445.0 / 795.0)
    assert row["mfu"] < 0.45 < row["mfu_vs_matmul"]  # the goal is judged on the first (the field's MFU)
    cpu = train.train_row(r, "cpu", peak=None, roof=0.002)
    assert cpu["mfu"] is None and cpu["mfu_vs_matmul"] is None and cpu["tokens_per_s"] == 5e4


def test_overlap_rows_differ_only_by_the_overlap_flags():
    without, with_overlap = train.VARIANTS["dist-opt"], train.VARIANTS["dist-opt+overlap"]
    assert "--use-distributed-optimizer" in without
    assert with_overlap == (*without, *train.OVERLAP_ARGS) and "--overlap-grad-reduce" in train.OVERLAP_ARGS
    assert "DP=1" in train.VARIANT_NOTE
