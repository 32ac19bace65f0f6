"""benchmarks/campaign/runner.py: the command line and the results file's name."""

from __future__ import annotations

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
    """The parent derives the headline figures after each phase (here a train phase killed at its budget)
    and records the revision; the folder holds the results file and its log, nothing else."""
    from benchmarks.campaign import schema
    from tests.benchmarks.fixtures import gpu_result

    kept = gpu_result()
    rows = [{**row, "flops_per_token": f} for row, f in zip(kept["train"], (9.0, 10.0), strict=True)]
    parts = {
        "env": {"_status": "ok", "device": "cpu (x86_64)", "device_type": "cpu", "bf16_matmul_tflops": 0.01},
        "train": {"_status": "timeout", "_error": "killed after 30s", "train": rows},
    }
    seen = []

    def run_child(phase, budget, a, device_type, figures, log, reuse=None):
        seen.append((phase, device_type, figures.get("bf16_matmul_tflops")))
        return dict(parts[phase]), 1.0

    monkeypatch.setattr(runner, "run_child", run_child)
    out = tmp_path / "out"
    assert runner.main(["--smoke", "--device", "cpu", "--phase", "train", "--out", str(out)]) == 0
    assert seen == [("env", "cpu", None), ("train", "cpu", 0.01)]
    (path,) = out.glob("campaign-cpu-x86-64-*.json")
    result = json.loads(path.read_text())
    assert result["phases"]["train"]["status"] == "timeout"
    assert result["diff_vs_transformer_ratio_4k"] == pytest.approx(48211.0 / 51234.0)
    assert result["git_source"] == "git" and len(result["git_revision"]) == 40
    assert not set(schema.RETIRED_TOP_LEVEL) & set(result)  # the retired kernel's keys: history only
    names = sorted(p.name for p in out.iterdir())  # within the device tool's 8 files back, none in folders
    assert len(names) == 2 and all((out / n).is_file() for n in names)


def test_prepare_stamps_the_checkout_into_the_carried_folder(tmp_path, capsys):
    from benchmarks.campaign.source import STAMP_NAME

    assert runner.main(["--prepare", "--wheels", str(tmp_path)]) == 0
    stamp = json.loads((tmp_path / STAMP_NAME).read_text())
    assert len(stamp["git_revision"]) == 40 and "benchmarks/campaign/runner.py" in stamp["files"]
    assert "no megatron_core wheel" in capsys.readouterr().out
