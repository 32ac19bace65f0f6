"""benchmarks/campaign/runner.py: the command line and the results file's name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.campaign import runner


def test_file_names_and_arguments():
    assert runner.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert runner.slug("cpu (x86_64)") == "cpu-x86-64"
    assert runner.main(["--phase", "env,bogus", "--out", "/tmp/never-made"]) == 2
    assert runner.main(["--phase", "memory", "--phase-budget", "memory=lots", "--out", "/tmp/never"]) == 2
    assert runner.main(["--phase", "memory", "--phase-budget", "nap=10", "--out", "/tmp/never"]) == 2


def test_figures_and_provenance_reach_the_results_file(tmp_path, monkeypatch):
    """The parent derives the headline figures after each phase (here a kernels phase killed at its
    budget) and records the revision, the env phase's peak and the Triton cache it saved."""
    from tests.benchmarks.fixtures import gpu_result

    kept = gpu_result()
    parts = {
        "env": {"_status": "ok", "device": "cpu (x86_64)", "device_type": "cpu", "bf16_matmul_tflops": 0.01},
        "kernels": {
            "_status": "timeout",
            "_error": "killed after 30s",
            "attention": [r for r in kept["attention"] if not r["error"]],
            "triton_candidates": kept["triton_candidates"],
        },
    }
    seen = []

    def run_child(phase, budget, a, device_type, figures, tiles, log, reuse=None):
        seen.append((phase, device_type, figures.get("bf16_matmul_tflops")))
        return dict(parts[phase]), 1.0

    monkeypatch.setattr(runner, "run_child", run_child)
    plan = dataclasses.replace(runner.SMOKE_PLAN, attn_head_dim=128)
    monkeypatch.setattr(runner, "plan_for", lambda smoke: plan)
    cache = tmp_path / "triton"
    (cache / "k1").mkdir(parents=True)
    (cache / "k1" / "k.cubin").write_bytes(b"\0" * 64)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    out = tmp_path / "out"
    assert runner.main(["--smoke", "--device", "cpu", "--phase", "kernels", "--out", str(out)]) == 0
    assert seen == [("env", "cpu", None), ("kernels", "cpu", 0.01)]
    (path,) = out.glob("campaign-cpu-x86-64-*.json")
    result = json.loads(path.read_text())
    assert result["phases"]["kernels"]["status"] == "timeout"
    assert result["fused_speedup_vs_best_unfused_4k"] == pytest.approx(6.5 / 4.8)
    assert result["triton_best"]["label"] == "f64x16s2w4 kv16x128 q128x16 w8"
    assert result["git_source"] == "git" and len(result["git_revision"]) == 40
    assert result["triton_cache"]["saved"]["entries"] == 1 and (out / "triton-cache.tar.gz").is_file()
    names = sorted(p.name for p in out.iterdir())  # within the device tool's 8 files back, none in folders
    assert len(names) == 4 and all((out / n).is_file() for n in names)
    assert names[2:] == ["triton-cache.tar.gz", f"triton-tiles-{names[0][9:25]}.json"]  # tiles: for train


def test_prepare_stamps_the_checkout_into_the_carried_folder(tmp_path, capsys):
    from benchmarks.campaign.source import STAMP_NAME

    assert runner.main(["--prepare", "--wheels", str(tmp_path)]) == 0
    stamp = json.loads((tmp_path / STAMP_NAME).read_text())
    assert len(stamp["git_revision"]) == 40 and "benchmarks/campaign/runner.py" in stamp["files"]
    assert "no megatron_core wheel" in capsys.readouterr().out
