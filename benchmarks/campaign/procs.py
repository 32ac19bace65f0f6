"""Child-process plumbing: the environment of a phase, process groups, reading output until a deadline."""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ):
        env.pop(key, None)  # every run here is one process: never join an outer launcher's job
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def lines_until(proc: subprocess.Popen, end: float):
    """The child's output lines until it exits or the time is up."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        if not sel.select(timeout=min(left, 5.0)):
            if proc.poll() is not None:
                return
            continue
        line = proc.stdout.readline()
        if not line:
            return
        yield line
