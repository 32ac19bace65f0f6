"""benchmarks/train_step.py: --device cpu hides the GPUs before CUDA is first queried."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.train_step import baseline_of
from tests.conftest import REPO_ROOT

_PROBE = """
import os, sys, torch
class FirstQuery(Exception):
    pass
def probe():
    print("CUDA_VISIBLE_DEVICES at the first CUDA query:", repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
    raise FirstQuery
torch.cuda.is_available = probe
torch.cuda.device_count = probe
sys.path.insert(0, sys.argv[1])
from benchmarks import train_step
try:
    train_step.main(["--device", "cpu", "--model", "diff-tiny"])
except FirstQuery:
    pass
"""


def test_cpu_device_is_set_before_cuda_is_queried():
    """torch caches the device count at the first query: CUDA_VISIBLE_DEVICES set later is ignored."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(REPO_ROOT)], capture_output=True, text=True, timeout=300
    )
    assert "CUDA_VISIBLE_DEVICES at the first CUDA query: ''" in proc.stdout, (
        proc.stdout + proc.stderr[-2000:]
    )


def test_baselines_of_diff_presets():
    assert baseline_of("diff-3b") == "transformer-3b"
    assert baseline_of("diff2-1.4b") == "transformer-1.4b"
    assert baseline_of("transformer-3b") is None


def test_a_row_is_charged_only_with_its_own_memory(monkeypatch):
    """What earlier runs of the process still hold is not this run's peak (a GPU row once read 25.5 GiB
    over its plan: the previous run's weights and optimizer); what the run leaves behind is reported."""
    import torch

    from benchmarks import train_step

    gib = 2**30
    state = {"allocated": 10 * gib, "peak": 10 * gib}

    def run(args, opts, device):  # a run that peaks 25 GiB above what it found and leaves 1 GiB
        state["peak"] = state["allocated"] + 25 * gib
        state["allocated"] += gib
        return {"seconds": 0.5, "backend": "sdpa", "profile": None}

    monkeypatch.setattr(train_step, "_time_steps", run)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["allocated"]))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    r = train_step.run_one("diff-tiny", 64, train_step.StepOptions(), "cuda")
    assert r["error"] is None and r["backend"] == "sdpa"
    assert (r["mem_gib"], r["resident_gib"], r["left_gib"]) == (25.0, 10.0, 1.0)
