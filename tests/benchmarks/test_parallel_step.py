"""benchmarks/parallel_step.py runs both items under torchrun with 2 ranks on a tiny model: each prints
both variants, the overlapped run in several buckets, the bubbles the schedule predicts, and the same
losses for both variants of a pair."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO_ROOT
from tests.distributed.runner import job_env, launch_cmd

ROW = r" +(\d+) +(\d+) +(\d+)$"  # median, min, max ms


def test_parallel_step_benchmark_prints_both_variants_per_item(tmp_path):
    flags = ["--model", "diff-tiny", "--mock-data", "--vocab-size", "512", "--seq-length", "32"]
    flags += ["--micro-batch-size", "1", "--eval-iters", "0", "--lr-warmup-iters", "1"]
    argv = [str(REPO_ROOT / "benchmarks" / "parallel_step.py"), "--steps", "2", "--warmup", "1"]
    argv += ["--ddp-bucket-size", "100000", *flags]
    proc = subprocess.run(
        launch_cmd(2, argv), env=job_env(tmp_path, 2), capture_output=True, text=True, timeout=600
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    assert re.search(
        r"^overlapped data-parallel communication: DP 2, 3\.3M parameters, 1 x 32 tokens", out, re.M
    )
    assert re.search(r"^dist-opt +1" + ROW, out, re.M), out
    buckets = re.search(r"^dist-opt \+ overlaps +(\d+)" + ROW, out, re.M)
    assert buckets and int(buckets[1]) > 1, out
    assert re.search(r"^interleaved pipeline: PP 2, 3\.3M parameters, 4 x 32 tokens", out, re.M)
    assert re.search(r"^1F1B +0\.250" + ROW, out, re.M), out
    assert re.search(r"^interleaved 1F1B, 2 chunks +0\.125" + ROW, out, re.M), out
    ratios = r"^with / without: \d+\.\d+x the median step time, \d+\.\d+x the median of steps side by side$"
    assert len(re.findall(ratios, out, re.M)) == 2, out
    same = re.findall(
        r"^same training: losses differ by at most (\S+) \(relative\), grad norms by (\S+)$", out, re.M
    )
    assert len(same) == 2 and all(float(loss) < 1e-5 and float(norm) < 1e-3 for loss, norm in same), out
    assert "pipeline bubble 0.125 of a step instead of 0.250" in out
    assert re.search(r"takes 0\.900x as long if the traffic were free$", out, re.M)
