"""benchmarks/campaign.py: budgets, the figures derived from rows, the gpu-test paths, wheels."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import campaign
from tests.benchmarks.fixtures import gpu_result
from tests.conftest import REPO_ROOT


def test_every_gpu_marked_test_is_on_the_campaigns_paths():
    """A `gpu` test outside GPU_TEST_PATHS would never run on the GPU machine."""
    marked = set()
    for path in (REPO_ROOT / "tests").rglob("test_*.py"):
        if re.search(r"pytest\.mark\.gpu\b", path.read_text()):
            marked.add(path.relative_to(REPO_ROOT).as_posix())
    assert marked, "no gpu-marked tests found"
    uncovered = [
        m for m in marked if not any(m == p or m.startswith(p + "/") for p in campaign.GPU_TEST_PATHS)
    ]
    assert not uncovered, uncovered
    for p in campaign.GPU_TEST_PATHS:
        assert (REPO_ROOT / p).exists(), p


@pytest.mark.parametrize("smoke", [False, True])
def test_budgets_fit_the_command(smoke):
    phases = list(campaign.PHASES)
    table = campaign.SMOKE_BUDGET_S if smoke else campaign.PHASE_BUDGET_S
    for total in (60.0, 300.0, 480.0, 10_000.0):
        budgets = campaign.phase_budgets(phases, total, smoke)
        assert sum(budgets.values()) <= total + 1e-9
        assert all(budgets[p] <= table[p] for p in phases)
    roomy = campaign.phase_budgets(["env", "train"], 10_000.0, smoke)
    assert roomy == {"env": table["env"], "train": table["train"]}
    tight = campaign.phase_budgets(["env", "tests", "kernels"], 200.0, smoke=False)
    assert tight["kernels"] == pytest.approx(200.0 - tight["env"] - tight["tests"])


def test_phase_budget_overrides():
    budgets = campaign.phase_budgets(["env", "memory"], 10_000.0, smoke=True, overrides={"memory": 900.0})
    assert budgets == {"env": campaign.SMOKE_BUDGET_S["env"], "memory": 900.0}
    assert campaign.main(["--phase", "memory", "--phase-budget", "memory=lots", "--out", "/tmp/never"]) == 2
    assert campaign.main(["--phase", "memory", "--phase-budget", "nap=10", "--out", "/tmp/never"]) == 2


def test_fused_speedup_and_best_tiles_skip_wrong_and_failed_candidates():
    rows = gpu_result()["attention"]
    rows.append({**rows[2], "impl": "diff triton fast-but-wrong", "fwd_bwd_ms": 0.5, "correct": False})
    best = campaign.best_triton(rows, 4096, 128)
    assert best["impl"] == "diff triton f64x16s2w4 kv16x128 q128x16 w8"
    assert campaign.fused_speedup(rows, 4096, 128) == pytest.approx(6.5 / 4.8)
    assert campaign.fused_speedup(rows, 2048, 128) is None


def test_throughput_ratio_uses_the_best_diff_backend():
    rows = [
        {"seq": 4096, "arch": "transformer", "tokens_per_s": 100.0, "flops_per_token": 9.0, "error": None},
        {"seq": 4096, "arch": "diff", "tokens_per_s": 90.0, "flops_per_token": 10.0, "error": None},
        {"seq": 4096, "arch": "diff", "tokens_per_s": 93.0, "flops_per_token": 10.0, "error": None},
        {"seq": 4096, "arch": "diff", "tokens_per_s": None, "flops_per_token": 10.0, "error": "OOM"},
        {"seq": 4096, "arch": "diff2", "tokens_per_s": 99.0, "flops_per_token": 11.0, "error": None},
    ]
    assert campaign.throughput_ratio(rows, 4096) == (pytest.approx(0.93), pytest.approx(0.9))
    assert campaign.throughput_ratio(rows, 2048) == (None, None)


def test_flop_bound_of_the_3b_presets_matches_the_design():
    assert campaign.flop_bound("diff-3b", 4096) == pytest.approx(0.956, abs=5e-4)
    assert campaign.flop_bound("diff-3b", 2048) == pytest.approx(0.976, abs=5e-4)


def test_tuned_tiles_come_from_the_newest_file_of_the_same_gpu(tmp_path):
    old, new = gpu_result("2026-12-01T00:00:00+00:00"), gpu_result("2026-12-05T00:00:00+00:00")
    new["triton_best"] = {"label": "newer", "head_dim": 128, "config": {}}
    other = gpu_result("2026-12-09T00:00:00+00:00")
    other["device"], other["triton_best"] = "NVIDIA H200", {"label": "h200", "head_dim": 128, "config": {}}
    for name, r in (("a.json", old), ("b.json", new), ("c.json", other)):
        (tmp_path / name).write_text(json.dumps(r))
    assert campaign.kept_triton_best(tmp_path, "NVIDIA H100 80GB HBM3")["label"] == "newer"
    assert campaign.kept_triton_best(tmp_path, "NVIDIA A100") is None


def test_file_names_and_arguments():
    assert campaign.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert campaign.slug("cpu (x86_64)") == "cpu-x86-64"
    assert campaign.main(["--phase", "env,bogus", "--out", "/tmp/never-made"]) == 2


def test_installed_wheels_are_not_installed_again(tmp_path, monkeypatch):
    import importlib.metadata

    version = importlib.metadata.version("pytest")
    (tmp_path / f"pytest-{version}-py3-none-any.whl").write_bytes(b"")
    calls = []
    monkeypatch.setattr(campaign.subprocess, "run", lambda *a, **k: calls.append(a))
    assert campaign.install_wheels(tmp_path, lambda line: None) == [] and calls == []
