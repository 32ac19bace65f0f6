"""benchmarks/campaign/train.py: the layer count two models fit, and the phase run whole with fake workers
(the smoke plan's comparisons: both twins' windows in every lever row, a train row per variant)."""

from __future__ import annotations

import argparse

from benchmarks.campaign import train
from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import GPU_PLAN, SMOKE_PLAN
from benchmarks.campaign.train_plan import Variant
from tests.benchmarks.campaign.fakes import FakeWorkers


def test_the_layers_at_which_two_models_fit_the_gpu_by_the_memory_plan():
    """8-layer 3B-wide rows plan 34-37 GiB each: two fit an H200 (139 GiB), not an H100 (79 GiB), whose
    pairs run 6 layers; a CPU runs the plan's last count."""
    assert train.fit_layers(GPU_PLAN, 139.8) == 8
    assert train.fit_layers(GPU_PLAN, 79.2) == 6
    assert train.fit_layers(GPU_PLAN, 1.0) == GPU_PLAN.train_layers[-1]
    assert train.fit_layers(SMOKE_PLAN, None) == 2


def test_the_smoke_plans_phase_writes_both_twins_windows_and_a_row_per_variant(monkeypatch, tmp_path):
    workers = FakeWorkers()
    monkeypatch.setattr(train, "Worker", lambda env: workers.spawn())
    a = argparse.Namespace(device="cpu", peak=None, roof=None, gpu_gib=None, continue_from=None)
    part = Part(tmp_path / "train.json")
    train.phase_train(a, part, deadline=float("inf"), plan=SMOKE_PLAN)
    levers = part.data["levers"]
    assert len(levers) == 3 and all(row["error"] is None for row in levers)
    for row in levers:
        assert len(row["off_windows"]) == len(row["on_windows"]) == SMOKE_PLAN.train_windows
        assert row["gain"] and row["on_flags"] == row["on"] and row["kind"] in ("lever", "ratio")
    rows = part.data["train"]
    assert [(r["model"], r["impl"]) for r in rows] == [
        ("transformer-tiny", "defaults"),
        ("transformer-tiny", "fast path"),
        ("diff-tiny", "fast path"),
        ("diff-tiny", "defaults"),
    ]
    assert all(r["tokens_per_s"] and r["windows"] and r["warmup_windows"] and r["layers"] == 2 for r in rows)
    assert rows[1]["profiled"] and not rows[0]["profiled"]  # the fast paths at the first length
    assert len(rows[1]["windows"]) == 2 * SMOKE_PLAN.train_windows  # in two comparisons: the anchor
    assert workers.max_alive == 2 and workers.alive == set()


def test_a_variant_that_never_built_has_a_row_that_says_why():
    row = train.variant_row(Variant("diff-3b", "diff", 4096, "fast path", ("--x",)), {}, 6, 4, True)
    assert row["layers"] == 6 and row["tokens_per_s"] is None and row["flags"] == ["--x"]
    assert row["variant"] is None and row["error"].startswith("unfinished")
