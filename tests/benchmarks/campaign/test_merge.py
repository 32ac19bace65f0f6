"""benchmarks/campaign/merge.py: `--continue` makes one results file of commands of one revision and GPU."""

from __future__ import annotations

import json

import pytest

from benchmarks.campaign import schema
from benchmarks.campaign.merge import ContinueError, load_earlier, merged
from tests.benchmarks.fixtures import gpu_result


def _earlier(tmp_path, **changes):
    r = gpu_result()
    r.update(changes)
    path = tmp_path / "campaign-earlier.json"
    path.write_text(json.dumps(r))
    return path, r


def test_only_one_clean_revision_is_continued(tmp_path):
    path, r = _earlier(tmp_path)
    assert load_earlier(path, r["git_revision"], False, smoke=False) == r
    with pytest.raises(ContinueError, match="it ran 0123456789ab, this tree is fedcba987654; only one clean"):
        load_earlier(path, "fedcba9876543210", False, smoke=False)
    with pytest.raises(ContinueError, match=r"this tree is 0123456789ab \(modified\)"):
        load_earlier(path, r["git_revision"], True, smoke=False)
    dirty, _ = _earlier(tmp_path, git_dirty=True)
    with pytest.raises(ContinueError, match=r"it ran 0123456789ab \(modified\)"):
        load_earlier(dirty, "0123456789abcdef", False, smoke=False)
    with pytest.raises(ContinueError, match="a GPU run; this one is not"):
        load_earlier(path, r["git_revision"], False, smoke=True)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ContinueError, match="not a campaign results file: not readable JSON"):
        load_earlier(tmp_path / "bad.json", "x", False, smoke=False)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ContinueError, match="not a campaign results file"):
        load_earlier(tmp_path / "other.json", "x", False, smoke=False)


def test_the_phases_run_now_replace_theirs_and_the_rest_are_kept(tmp_path):
    _, earlier = _earlier(tmp_path)  # env, kernels (partial), train rows, tests
    current = schema.empty_result()
    current.update(
        date="2026-12-01T11:00:00+00:00", device=earlier["device"], device_type="cuda",
        git_revision="0123456789abcdef", git_dirty=False, smoke=False, bf16_matmul_tflops=790.0,
        peak_bf16_tflops=989.4,
        gpu_train_run=[{"model": "diff-tiny", "iterations": 50, "loss_first": 11.5, "loss_last": 7.7,
                        "resume_exact": True, "generation_ok": True, "error": None}],
        attention=[{"impl": "stale", "seq": 1, "batch": 1, "head_dim": 8}],  # a phase not run: ignored
    )  # fmt: skip
    current["phases"]["env"] = {"status": "ok", "seconds": 9.0, "error": None}
    current["phases"]["memory"] = {"status": "ok", "seconds": 265.0, "error": None}
    out = merged(earlier, "campaign-earlier.json", current, ["env", "memory"])
    assert out["continues"] == ["campaign-earlier.json"]
    assert out["phases"]["kernels"] == earlier["phases"]["kernels"]  # kept, status and all
    assert out["phases"]["memory"]["status"] == "ok" and out["phases"]["env"]["seconds"] == 9.0
    assert out["attention"] == earlier["attention"] and out["train"] == earlier["train"]
    assert out["tests"] == earlier["tests"]
    assert out["gpu_train_run"] == current["gpu_train_run"]
    assert (out["date"], out["bf16_matmul_tflops"]) == ("2026-12-01T11:00:00+00:00", 790.0)
    assert out["diff_vs_transformer_ratio_4k"] == earlier["diff_vs_transformer_ratio_4k"]
    assert schema.validate(out) == []
    again = merged(out, "campaign-second.json", current, ["env"])  # a third command names both
    assert again["continues"] == ["campaign-earlier.json", "campaign-second.json"]


def test_another_gpu_is_not_merged(tmp_path):
    _, earlier = _earlier(tmp_path)
    current = {**schema.empty_result(), "device": "NVIDIA H200", "device_type": "cuda"}
    with pytest.raises(ContinueError, match="it ran on NVIDIA H100 80GB HBM3, this command on NVIDIA H200"):
        merged(earlier, "campaign-earlier.json", current, ["env"])
