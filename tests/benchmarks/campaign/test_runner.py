"""benchmarks/campaign/runner.py: the command line and the results file's name."""

from __future__ import annotations

import json

import pytest

from benchmarks.campaign import runner


def test_file_names_and_arguments():
    from benchmarks.campaign.results_file import slug

    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert slug("cpu (x86_64)") == "cpu-x86-64"
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

    def run_child(phase, budget, a, device_type, figures, log, reuse=None, on_update=None):
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


def test_the_results_file_is_whole_on_disk_whenever_a_phase_saved_rows(tmp_path, monkeypatch):
    """A command stopped at any moment, even killed by the device tool at its limit, leaves a results file
    holding what it measured: written after the env phase and each time the train phase's child saved."""
    out = tmp_path / "out"
    on_disk = []

    def row(i):
        return {"model": "diff-tiny", "impl": f"v{i}", "arch": "diff", "seq": 64, "tokens_per_s": 10.0 + i,
                "mfu": None, "error": None, "windows": [10.0 + i] * 2}  # fmt: skip

    def run_child(phase, budget, a, device_type, figures, log, reuse=None, on_update=None):
        if phase == "env":
            return {"_status": "ok", "device": "cpu (x86_64)", "device_type": "cpu"}, 1.0
        for i in range(3):
            on_update({"_status": "ok", "train": [row(j) for j in range(i + 1)]})
            (path,) = out.glob("campaign-*.json")
            written = json.loads(path.read_text())
            on_disk.append((len(written["train"]), written["phases"]["train"]["status"]))
        raise KeyboardInterrupt  # the command is killed here, in the middle of its train phase

    monkeypatch.setattr(runner, "run_child", run_child)
    with pytest.raises(KeyboardInterrupt):
        runner.main(["--smoke", "--device", "cpu", "--phase", "train", "--out", str(out)])
    assert on_disk == [(1, "partial"), (2, "partial"), (3, "partial")]
    (path,) = out.glob("campaign-*.json")
    kept = json.loads(path.read_text())
    assert kept["phases"]["train"]["error"] == "unfinished: the command ended here"
    assert kept["phases"]["env"]["status"] == "ok" and [r["impl"] for r in kept["train"]] == [
        "v0",
        "v1",
        "v2",
    ]
    assert sorted(p.suffix for p in out.iterdir()) == [".json", ".log"]  # no temporary file left


def test_lent_gpu_is_the_env_and_train_phases_within_the_budgets():
    from benchmarks.campaign import plan

    a = runner.parse_args(["--lent-gpu", "--out", "x"])
    assert (a.phase, a.budget, a.phase_budget) == ("env,train", plan.LENT_GPU_S, [f"train={plan.LENT_GPU_S}"])
    a = runner.parse_args(["--lent-gpu", "--continue", "f.json", "--out", "x"])
    assert a.budget == plan.LENT_CONTINUE_S
    assert runner.parse_args(["--lent-gpu", "--budget", "300", "--out", "x"]).budget == 300
