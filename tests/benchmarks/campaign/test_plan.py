"""benchmarks/campaign/plan.py: the gpu-test paths and the phase budgets."""

from __future__ import annotations

import re

import pytest

from benchmarks.campaign import plan
from tests.conftest import REPO_ROOT


def test_every_gpu_marked_test_is_on_the_campaigns_paths():
    """A `gpu` test outside GPU_TEST_PATHS would never run on the GPU machine."""
    marked = set()
    for path in (REPO_ROOT / "tests").rglob("test_*.py"):
        if re.search(r"pytest\.mark\.gpu\b", path.read_text()):
            marked.add(path.relative_to(REPO_ROOT).as_posix())
    assert marked, "no gpu-marked tests found"
    uncovered = [m for m in marked if not any(m == p or m.startswith(p + "/") for p in plan.GPU_TEST_PATHS)]
    assert not uncovered, uncovered
    for p in plan.GPU_TEST_PATHS:
        assert (REPO_ROOT / p).exists(), p


@pytest.mark.parametrize("smoke", [False, True])
def test_budgets_fit_the_command(smoke):
    phases = list(plan.PHASES)
    table = plan.SMOKE_BUDGET_S if smoke else plan.PHASE_BUDGET_S
    for total in (60.0, 300.0, 480.0, 10_000.0):
        budgets = plan.phase_budgets(phases, total, smoke)
        assert sum(budgets.values()) <= total + 1e-9
        assert all(budgets[p] <= table[p] for p in phases)
    roomy = plan.phase_budgets(["env", "train"], 10_000.0, smoke)
    assert roomy == {"env": table["env"], "train": table["train"]}
    tight = plan.phase_budgets(["env", "tests", "kernels"], 200.0, smoke=False)
    assert tight["kernels"] == pytest.approx(200.0 - tight["env"] - tight["tests"])


def test_phase_budget_overrides():
    budgets = plan.phase_budgets(["env", "memory"], 10_000.0, smoke=True, overrides={"memory": 900.0})
    assert budgets == {"env": plan.SMOKE_BUDGET_S["env"], "memory": 900.0}
