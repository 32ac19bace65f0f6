"""benchmarks/campaign/estimate.py and `--plan`: the device time the two lent-GPU commands take, at the rate
of the newest GPU results file, within a session's 15 minutes; docs/gpu.md quotes it."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.campaign import estimate, plan, runner, schema, train_plan
from tests.conftest import REPO_ROOT

LAST_LINE = re.compile(r"^device time: (\d+) s in (\d+) commands$")


def _plan_output(capsys) -> list[str]:
    assert runner.main(["--plan"]) == 0
    return capsys.readouterr().out.rstrip("\n").splitlines()


def test_plan_ends_with_the_device_time_of_two_commands_within_the_session(capsys):
    lines = _plan_output(capsys)
    found = LAST_LINE.match(lines[-1])
    assert found, lines[-1]
    seconds, commands = int(found.group(1)), int(found.group(2))
    assert commands == 2 and plan.DEVICE_START_S + 2 * 60 < seconds <= plan.DEVICE_PLAN_MAX_S
    assert plan.LENT_GPU_S <= 510 and plan.LENT_CONTINUE_S <= 180
    comps = train_plan.comparisons(plan.GPU_PLAN)
    listed = [line for line in lines if re.match(r"^\s+\d+ (cmd [12]|later) ", line)]
    assert len(listed) == len(comps)
    first = [line for line in listed if " cmd 1 " in line]
    assert first and all(" cmd 1 " in line for line in listed[: len(first)])  # the first command: the start
    assert "s4096" in first[-1] or "s2048" in first[-1]
    assert "campaign-nvidia-h100-80gb-hbm3-20261124T071510Z.json" in "\n".join(lines)  # the rate's source


def test_docs_gpu_md_quotes_the_plans_device_time(capsys):
    """The doc's arithmetic is --plan's output, not a figure typed once and left behind."""
    lines = _plan_output(capsys)
    text = (REPO_ROOT / "docs" / "gpu.md").read_text()
    assert "```\n" + "\n".join(lines) + "\n```" in text  # the whole output, as --plan prints it today
    assert "three commands" not in text and "30 minutes" not in text and "Triton cache" not in text


def _results_file(folder, name, rows, seconds=233.7, device_type="cuda", smoke=False, status="ok"):
    r = schema.empty_result()
    r.update(date="2026-12-01T00:00:00+00:00", device="NVIDIA H100 80GB HBM3", device_type=device_type,
             git_revision="0" * 40, smoke=smoke, machine={"gpu_memory_gib": 79.2}, train=rows)  # fmt: skip
    r["phases"]["env"] = {"status": "ok", "seconds": 10.0, "error": None}
    r["phases"]["train"] = {"status": status, "seconds": seconds, "error": None}
    (folder / name).write_text(json.dumps(r))


def _row(seq, tokens_per_s, **kw):
    return {"model": "m", "impl": "x", "seq": seq, "micro_batch_size": 4096 // seq, "microbatches": 4,
            "tokens_per_s": tokens_per_s, "mfu": None, "error": None, **kw}  # fmt: skip


def test_the_rate_of_a_file_before_and_after_the_interleaved_design(tmp_path):
    _results_file(
        tmp_path, "campaign-gpu-20261124T000000Z.json", [_row(4096, 16384.0)] * 9 + [_row(2048, 8192.0)]
    )
    rate = estimate.rate_from(tmp_path)
    assert rate.build_s == pytest.approx(23.37) and "23.4 s a run" in rate.how
    assert rate.step_s == {4096: pytest.approx(1.0), 2048: pytest.approx(2.0)}
    assert rate.command_s == 10.0 + estimate.INSTALL_S
    # newer files that do not count: a smoke run, a CPU, an unfinished train phase
    _results_file(tmp_path, "campaign-cpu-20261201T000000Z.json", [_row(4096, 1.0)], device_type="cpu")
    _results_file(tmp_path, "campaign-gpu-20261202T000000Z.json", [_row(4096, 1.0)], status="partial")
    assert estimate.rate_from(tmp_path).source == "campaign-gpu-20261124T000000Z.json"
    builds = [_row(4096, 16384.0, build_s=30.0, step_s=1.1), _row(4096, 8192.0, build_s=40.0, step_s=2.2),
              _row(4096, 8192.0, build_s=50.0, **{"from": "campaign-earlier.json"})]  # fmt: skip
    _results_file(tmp_path, "campaign-gpu-20261203T000000Z.json", builds)
    rate = estimate.rate_from(tmp_path)
    assert rate.build_s == 35.0 and rate.step_s == {4096: 2.2}  # this command's builds, the slowest step
    assert estimate.rate_from(tmp_path / "none") is None


def test_the_simulation_fills_each_command_and_leaves_the_rest(tmp_path):
    comps = train_plan.comparisons(plan.GPU_PLAN)
    rate = estimate.Rate(20.0, {4096: 0.5, 2048: 0.5}, 10.0, "x.json", "test")
    placed, totals = estimate.simulate(comps, rate, (200.0, 100.0), window_steps=2, windows=3)
    assert [p.command for p in placed][:6] == [1, 1, 1, 1, 1, 2]
    assert all(t <= budget - 20 for t, budget in zip(totals, (200.0, 100.0), strict=True))  # the margin
    assert placed[0].builds == 2 and placed[0].seconds == pytest.approx(2 * 20 + 6 + 5.5)  # + a profile
    assert placed[1].builds == 1
    assert placed[5].builds == 2  # a new command builds its first comparison's twins again
    assert placed[-1].command is None and placed[-1].seconds == 0.0
    assert estimate.device_time_line(totals) == f"device time: {120 + sum(totals):.0f} s in 2 commands"
