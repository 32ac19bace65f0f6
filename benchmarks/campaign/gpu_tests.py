"""Phase `tests`: `pytest -m gpu` on the GPU test paths, counted as it runs.

The CUDA-path confirmations (tests/test_gpu_readiness.py) run first and the kernel tests last. On a GPU
machine with pytest-xdist the tests run in GPU_TEST_WORKERS processes, and a test that crashes its process
(a CUDA fault) is one failed test instead of the end of the run. Counts come from the per-test lines as they
arrive (a run cut short by the budget keeps what it got through), collection errors included; pytest's
closing summary line, where it is reached, is the final count.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import time

from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import GPU_TEST_PATHS, GPU_TEST_WORKERS, Plan, device_of
from benchmarks.campaign.procs import REPO, child_env, end, lines_until

_OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_TEST_LINE = re.compile(rf"^(\S+::\S+) ({_OUTCOMES})")  # `-v`: "tests/x.py::t PASSED  [ 10%]"
_XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_OUTCOMES}) (\S+::\S+)")  # "[gw0] [ 10%] PASSED x::t"
_COLLECT_ERROR = re.compile(r"^_+ ERROR collecting (\S+) _+$")
_SUMMARY = re.compile(
    r"^=+ (.*\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected).*) in [\d.]+s"
)
_KIND = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}
_SUMMARY_KIND = {"passed": "passed", "xpassed": "passed", "failed": "failed", "error": "errors",
                 "errors": "errors", "skipped": "skipped", "xfailed": "skipped"}  # fmt: skip


class PytestCounter:
    """Counts of a `pytest -v` run (plain or pytest-xdist) from its output lines."""

    def __init__(self) -> None:
        self.counts: dict = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
        self.finished = False

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        m = _TEST_LINE.match(line)
        outcome, test = (m.group(2), m.group(1)) if m else (None, None)
        m = _XDIST_LINE.match(line)
        if m:
            outcome, test = m.group(1), m.group(2)
        if outcome:
            kind = _KIND.get(outcome, "skipped")
            self.counts[kind] += 1
            if kind in ("failed", "errors"):
                self.counts["failures"].append(test)
            return
        m = _COLLECT_ERROR.match(line)
        if m:
            self.counts["errors"] += 1
            self.counts["failures"].append(f"{m.group(1)} (collection error)")
            return
        m = _SUMMARY.match(line)
        if m:  # pytest's own totals: every error (collection, setup, teardown) counted once
            totals = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
            for number, word in re.findall(r"(\d+) (\w+)", m.group(1)):
                if word in _SUMMARY_KIND:
                    totals[_SUMMARY_KIND[word]] += int(number)
            self.counts.update(totals)
            self.finished = True


def pytest_command(paths: tuple[str, ...], workers: int) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rfE"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    return cmd + ["--continue-on-collection-errors", *paths]


def phase_tests(
    a: argparse.Namespace, part: Part, deadline: float, plan: Plan, paths: tuple[str, ...] = GPU_TEST_PATHS
) -> None:
    """`pytest -m gpu -v` on `paths` (run from the checkout's root) until the deadline."""
    xdist = importlib.util.find_spec("xdist") is not None
    workers = GPU_TEST_WORKERS if device_of(a) == "cuda" and xdist else 1
    proc = subprocess.Popen(
        pytest_command(paths, workers), cwd=REPO, env=child_env(a), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,  # its workers end with it
    )  # fmt: skip
    counter = PytestCounter()
    counts = counter.counts
    counts.update(timed_out=False, workers=workers)
    try:
        for line in lines_until(proc, deadline):
            if line is None:  # a second without output
                continue
            print(line.rstrip("\n"), flush=True)
            counter.feed(line)
            part.set(tests=counts)
        if proc.poll() is None:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                counts["timed_out"] = True
    finally:
        end(proc)  # pytest, its workers and whatever a test started
    if proc.returncode not in (0, 1, 5) and not counts["timed_out"] and not counter.finished:
        counts["errors"] += 1  # 5: nothing collected; others: pytest itself broke
        counts["failures"].append(f"pytest exited with {proc.returncode}")
    part.set(tests=counts)
    if counts["timed_out"]:
        part.set(_status="partial", _error="pytest ran past the phase budget")
