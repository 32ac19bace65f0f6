"""benchmarks/async_save.py runs end to end on a tiny model and prints both modes and the goal's verdict."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO_ROOT
from tests.distributed.runner import job_env, launch_cmd


def test_async_save_benchmark_prints_both_modes(tmp_path):
    flags = ["--model", "diff-tiny", "--mock-data", "--vocab-size", "512", "--seq-length", "32"]
    flags += ["--micro-batch-size", "1", "--global-batch-size", "1", "--eval-iters", "0"]
    argv = [str(REPO_ROOT / "benchmarks" / "async_save.py"), "--saves", "2", "--save-interval", "2"]
    argv += ["--warmup", "1", "--save-dir", str(tmp_path), *flags]
    proc = subprocess.run(
        launch_cmd(1, argv), env=job_env(tmp_path, 1), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"^normal step: \d+ ms, \d+K page faults \(medians of \d+ steps\)$", proc.stdout, re.M)
    assert re.search(r"^sync +1 +1 +\d+ +[\d.]+x +\d+K +\d+ ms +\d+$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^async +1 +\d+ +\d+ +[\d.]+x +\d+K +\d+ ms +\d+", proc.stdout, re.M), proc.stdout
    assert re.search(r"^async save\(\) calls \(ms\): \d+ \(", proc.stdout, re.M), proc.stdout
    assert re.search(r"^writer process: [\d.]+ s CPU per async save \([\d.]+ s user", proc.stdout, re.M)
    assert re.search(
        r"^goal: async overlapped steps within 1.2x of normal: (met|not met) \(", proc.stdout, re.M
    )
    assert not list(tmp_path.glob("async_save_*")), "the benchmark's checkpoints are removed"
