"""benchmarks/campaign/gpu_tests.py: the tests phase counts every outcome, collection errors included."""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.campaign import gpu_tests
from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import GPU_TEST_PATHS, SMOKE_PLAN

_TESTS = """
import pytest
pytestmark = getattr(pytest.mark, "gpu")  # not written out: test_plan.py would see a GPU test here
def test_ok(): pass
def test_bad(): assert 0
@pytest.mark.skip(reason="no GPU")
def test_skip(): pass
"""


def test_a_collection_error_is_counted(tmp_path):
    """A GPU test module that fails to import is an error with its path, not a silent nothing."""
    (tmp_path / "test_fine.py").write_text(_TESTS)
    (tmp_path / "test_broken.py").write_text("import not_a_module_anywhere\n")
    part = Part(tmp_path / "tests.json")
    a = argparse.Namespace(device="cpu")
    gpu_tests.phase_tests(a, part, time.monotonic() + 120, SMOKE_PLAN, paths=(str(tmp_path),))
    counts = json.loads((tmp_path / "tests.json").read_text())["tests"]
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 1, 1)
    assert any(f.endswith("test_bad") for f in counts["failures"])
    assert any("test_broken.py" in f for f in counts["failures"]) and counts["timed_out"] is False


def test_xdist_lines_and_a_crashed_worker_are_counted():
    """Lines as pytest-xdist 3.8 prints them with -v (a worker killed by an abort: one failed test)."""
    counter = gpu_tests.PytestCounter()
    for line in [
        "[gw1] [ 12%] SKIPPED t/test_a.py::test_skip ",
        "[gw0] [ 40%] PASSED t/test_a.py::test_ok ",
        "t/test_a.py::test_ok Fatal Python error: Aborted",
        "[gw1] node down: Not properly terminated",
        "[gw1] [ 75%] FAILED t/test_crash.py::test_crash ",
        "replacing crashed worker gw1",
        "______________________ ERROR collecting t/test_broken.py _______________________",
    ]:
        counter.feed(line + "\n")
    c = counter.counts
    assert (c["passed"], c["failed"], c["errors"], c["skipped"]) == (1, 1, 1, 1)
    assert c["failures"] == ["t/test_crash.py::test_crash", "t/test_broken.py (collection error)"]
    assert not counter.finished
    counter.feed("========= 1 failed, 3 passed, 1 skipped, 2 warnings, 1 error in 11.97s =========\n")
    assert (c["passed"], c["failed"], c["errors"], c["skipped"]) == (3, 1, 1, 1) and counter.finished


def test_the_cuda_confirmations_run_before_the_kernel_compilations():
    cmd = gpu_tests.pytest_command(GPU_TEST_PATHS, workers=4)
    assert cmd[cmd.index("-n") + 1] == "4"
    paths = cmd[-len(GPU_TEST_PATHS) :]
    assert paths.index("tests/test_gpu_readiness.py") < paths.index("tests/kernels")
    assert "-n" not in gpu_tests.pytest_command(GPU_TEST_PATHS, workers=1)
