"""Phase `tests`: `pytest -m gpu` on the GPU test paths, counted as it runs."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import GPU_TEST_PATHS, Plan
from benchmarks.campaign.procs import REPO, child_env, kill_group, lines_until

_TEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def phase_tests(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    """`pytest -m gpu -v`, counted from its per-test lines as they come (a run cut short by the budget
    still reports what it got through)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rfE"]
    cmd += ["--continue-on-collection-errors", *GPU_TEST_PATHS]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=child_env(a), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "timed_out": False}
    outcome = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}
    tail: list[str] = []
    try:
        for line in lines_until(proc, deadline):
            print(line.rstrip("\n"), flush=True)
            tail = (tail + [line])[-50:]
            m = _TEST_LINE.match(line)
            if m:
                key = outcome.get(m.group(2), "skipped")
                counts[key] += 1
                if key in ("failed", "errors"):
                    counts["failures"].append(m.group(1))
            part.set(tests=counts)
        if proc.poll() is None:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                counts["timed_out"] = True
    finally:
        if proc.poll() is None:
            kill_group(proc)
            proc.wait()
    if proc.returncode not in (0, 1, 5) and not counts["timed_out"]:  # 5: nothing collected
        counts["errors"] += 1
        counts["failures"].append(f"pytest exited with {proc.returncode}")
    part.set(tests=counts)
    if counts["timed_out"]:
        part.set(_status="partial", _error="pytest ran past the phase budget")
