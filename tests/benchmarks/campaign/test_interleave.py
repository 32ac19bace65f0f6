"""benchmarks/campaign/interleave.py with fake workers (scripted window timings, no model): the windows'
order, the gain (median over median, warm-up left out), two models alive at most, failures and the
deadline, and the rows on disk after every window."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks.campaign import interleave, train
from benchmarks.campaign.estimate import Rate, simulate
from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import GPU_PLAN
from benchmarks.campaign.train_plan import Comparison, Variant, comparisons
from tests.benchmarks.campaign.fakes import FakeWorkers


def _bench(tmp_path, workers: FakeWorkers, deadline: float = 1e9, rate: Rate | None = None, windows: int = 3):
    def spec(v: Variant) -> dict:
        return {"preset": v.model, "seq": v.seq, "flags": list(v.flags), "layers": 2}

    part = Part(tmp_path / "part.json")
    bench = interleave.Bench(
        workers.spawn, spec, lambda v, facts: train.variant_row(v, facts, 2, 1, False), part, deadline,
        window_steps=2, windows=windows, warmup_steps=4, rate=rate, mfu_of=(1000.0, 800.0),
        clock=workers.clock, log=lambda line: None,
    )  # fmt: skip
    return bench, part


def _pair() -> Comparison:
    off = Variant("diff-tiny", "diff", 64, "defaults", ())
    on = Variant("diff-tiny", "diff", 64, "fast path", ("--norm-impl", "torch"))
    return Comparison("fast path vs defaults (diff) s64", "lever", on, off, "models")


def test_windows_alternate_off_on_and_the_gain_is_the_median_over_the_median(tmp_path):
    script = {(): [5.0, 100.0, 300.0, 110.0], ("--norm-impl", "torch"): [1.0, 200.0, 210.0, 190.0]}
    workers = FakeWorkers(tokens_per_s=lambda spec, n: script[tuple(spec["flags"])][n])
    bench, part = _bench(tmp_path, workers)
    bench.run([_pair()])
    windows = [(flags, steps) for op, _, flags, steps in workers.calls if op == "window"]
    off, on = (), ("--norm-impl", "torch")
    assert windows == [(off, 4), (on, 4)] + [(off, 2), (on, 2)] * 3  # warm-ups, then off, on, off, on, ...
    (row,) = part.data["levers"]
    assert row["off_windows"] == pytest.approx([100.0, 300.0, 110.0])
    assert row["on_windows"] == pytest.approx([200.0, 210.0, 190.0])
    assert row["gain"] == pytest.approx(200.0 / 110.0) and row["error"] is None
    assert row["warmup_windows"] == {
        "off": [pytest.approx(5.0)],
        "on": [pytest.approx(1.0)],
    }  # not in the gain
    defaults, fast = part.data["train"]
    assert fast["windows"] == pytest.approx([200.0, 210.0, 190.0]) and fast["tokens_per_s"] == pytest.approx(
        200.0
    )
    assert fast["mfu"] == pytest.approx(1e9 * 200.0 / 1e12 / 1000.0)  # median tokens/s, FLOPs/token, peak
    assert fast["mfu_vs_matmul"] == pytest.approx(1e9 * 200.0 / 1e12 / 800.0)
    assert defaults["warmup_windows"] == [pytest.approx(5.0)] and defaults["error"] is None
    assert workers.alive == set()  # every worker stopped at the end


def test_the_gpu_plan_keeps_two_models_alive_and_builds_what_the_estimate_counts(tmp_path):
    workers = FakeWorkers()
    bench, part = _bench(tmp_path, workers)
    plan = comparisons(GPU_PLAN)
    bench.run(plan)
    assert workers.max_alive == 2
    rate = Rate(1.0, {4096: 0.1, 2048: 0.1}, 0.0, "x.json", "test")
    placed, _ = simulate(plan, rate, (1e9,), 2, 3)
    assert len(workers.built) == sum(p.builds for p in placed)  # the simulation's builds, no more
    levers = part.data["levers"]
    assert [row["lever"] for row in levers] == [c.name for c in plan]
    assert all(
        row["error"] is None and len(row["off_windows"]) == len(row["on_windows"]) == 3 for row in levers
    )
    keys = [(r["model"], r["seq"], tuple(r["flags"])) for r in part.data["train"]]
    assert len(keys) == len(set(keys)) == len({v.key for c in plan for v in (c.on, c.off)})  # a row a variant
    profiled = {(r["model"], r["seq"]) for r in part.data["train"] if r["profiled"]}
    assert profiled == {(m, 4096) for m in GPU_PLAN.train_models}  # each model's fast path at 4K, once
    fp8 = next(row for row in levers if row["lever"] == "FP8 on the fast path (transformer) s4096")
    assert "--fp8-format" in fp8["on"] and "--gradient-accumulation-fusion" not in fp8["off"]


def test_a_failed_build_or_step_is_recorded_and_the_rest_go_on(tmp_path):
    def fail(spec, op, n):
        if "sdpa_split_v_batched" in spec["flags"] and op == "build":
            return "OOM"
        if "sdpa_split_v" in spec["flags"] and op == "window" and n == 1:  # its first timed window
            return "RuntimeError: cuDNN refused"
        return None

    workers = FakeWorkers(fail=fail)
    bench, part = _bench(tmp_path, workers)
    bench.run(comparisons(GPU_PLAN)[:7])
    rows = {row["lever"]: row for row in part.data["levers"]}
    assert rows["attention sdpa_split_v_batched vs sdpa (diff) s4096"]["error"] == "on twin failed: OOM"
    assert (
        rows["attention sdpa_split_v vs sdpa (diff) s4096"]["error"]
        == "on twin failed: RuntimeError: cuDNN refused"
    )
    assert all(rows[name]["gain"] for name in list(rows)[5:])  # the comparisons after them ran
    train_rows = {r["impl"]: r for r in part.data["train"] if r["model"] == "diff-3b"}
    assert train_rows["fast path, sdpa_split_v_batched"]["error"] == "OOM"
    assert train_rows["fast path, sdpa_split_v"]["error"] == "RuntimeError: cuDNN refused"
    assert train_rows["fast path, sdpa_split_v"]["windows"] == []  # its warm-up window only
    builds = [flags for _, flags in workers.built if "sdpa_split_v_batched" in flags]
    assert builds == []  # the failed build was never counted as built, nor tried again
    assert workers.max_alive <= 2


def test_a_variant_that_failed_is_not_built_again(tmp_path):
    workers = FakeWorkers(fail=lambda spec, op, n: "OOM" if spec["flags"] == [] and op == "build" else None)
    bench, part = _bench(tmp_path, workers)
    first = _pair()
    again = Comparison("again", "lever", first.on, first.off, "models")
    bench.run([first, again])
    assert [row["error"] for row in part.data["levers"]] == ["off twin failed: OOM"] * 2
    assert sum(1 for op, _, flags, _ in workers.calls if op == "build" and flags == ()) == 1


def test_a_comparison_starts_only_if_its_estimate_fits_before_the_deadline(tmp_path):
    workers = FakeWorkers(tokens_per_s=lambda spec, n: 100.0, cost={"build": 10.0})  # a step: 1 s
    rate = Rate(10.0, {4096: 0.5}, 0.0, "x.json", "test")
    plan = comparisons(GPU_PLAN)[:4]  # 2 builds, then 1 build each
    bench, part = _bench(tmp_path, workers, deadline=75.0, rate=rate)
    bench.run(plan)
    errors = [row["error"] for row in part.data["levers"]]
    # the first, by the rate: 2 builds (20 s) + 6 windows of 2 steps (6 s) + a profile (5.5 s): it starts
    # and takes 2 x (10 + a 4-step warm-up) + 12 = 40 s; the second, by what was measured: a 14 s build
    # and 12 s of windows (and 6 s for its profile) end at 66 s; the third would end at 92 s
    assert errors == [None, None, interleave.SKIPPED, interleave.SKIPPED]
    assert part.data["_status"] == "partial"
    assert len(workers.built) == 3


def test_rows_are_on_disk_after_every_window(tmp_path):
    seen = []

    def tokens_per_s(spec, n):
        on_disk = json.loads((tmp_path / "part.json").read_text())
        rows = on_disk.get("levers") or [{"off_windows": [], "on_windows": []}]
        seen.append(len(rows[0]["off_windows"]) + len(rows[0]["on_windows"]))
        return 100.0

    workers = FakeWorkers(tokens_per_s=tokens_per_s)
    bench, part = _bench(tmp_path, workers)
    bench.run([_pair()])
    assert seen == [0, 0, 0, 1, 2, 3, 4, 5]  # two warm-ups, then one more window on disk each time
    assert [p.name for p in tmp_path.iterdir()] == ["part.json"]  # written whole: no temporary left


def test_comparisons_a_continued_file_measured_are_not_timed_again(tmp_path):
    workers = FakeWorkers()
    bench, part = _bench(tmp_path, workers)
    plan = comparisons(GPU_PLAN)[:3]
    bench.run(plan, done={plan[0].name})
    assert [row["lever"] for row in part.data["levers"]] == [c.name for c in plan[1:]]
    assert len(workers.built) == 3  # TF and DF for the ratio, then D0: T0 never


def test_a_rows_figures_are_the_median_of_its_windows():
    row = {"windows": [90.0, 110.0, 100.0], "tokens_per_step": 1000, "flops_per_token": 2e9,
           "flops_per_token_full_square": 2.2e9}  # fmt: skip
    interleave.update_row(row, peak=989.4, roof=795.0)
    assert row["tokens_per_s"] == statistics.median([90.0, 110.0, 100.0]) and row["step_s"] == 10.0
    assert row["mfu"] == pytest.approx(2e9 * 100 / 1e12 / 989.4)
    assert row["mfu"] < row["mfu_vs_matmul"] and row["mfu_full_square"] == pytest.approx(
        2.2e9 * 100 / 1e12 / 989.4
    )
    cpu = {**row, "windows": [50.0]}
    interleave.update_row(cpu, peak=None, roof=None)
    assert cpu["mfu"] is None and cpu["mfu_vs_matmul"] is None and cpu["tokens_per_s"] == 50.0
