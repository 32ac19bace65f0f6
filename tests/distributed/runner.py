"""Launch pretrain_diff.py as a real job (plain process or torchrun) and read back its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT, free_port

TINY = [
    "--model",
    "diff-tiny",
    "--mock-data",
    "--vocab-size",
    "512",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
]


def run_training(
    tmp: Path, name: str, extra: list[str], nproc: int = 1, check: bool = True, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run one job; metrics land in tmp/name.jsonl, its checkpoint (with --save) in tmp/name."""
    env = dict(
        os.environ,
        TORCHDYNAMO_DISABLE="1",
        TMPDIR=str(tmp),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
    )
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    script = str(REPO_ROOT / "pretrain_diff.py")
    argv = [*TINY, "--metrics-file", str(tmp / f"{name}.jsonl"), *extra]
    if nproc == 1:
        cmd = [sys.executable, script, *argv]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            script,
            *argv,
        ]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def read_losses(tmp: Path, name: str) -> dict[int, float]:
    lines = (tmp / f"{name}.jsonl").read_text().splitlines()
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, lines) if "lm_loss" in r}
