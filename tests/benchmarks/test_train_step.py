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
