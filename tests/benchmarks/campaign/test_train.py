"""benchmarks/campaign/train.py: MFU on both denominators; the overlap rows differ by the overlap flags."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from benchmarks.campaign import train


def test_mfu_against_the_dense_peak_and_the_measured_matmul():
    r = {"backend": "sdpa", "layers": 8, "mbs": 1, "microbatches": 4, "tokens_per_s": 5e4, "tflops": 445.0,
         "tflops_full_square": 480.0,
         "flops_per_token": 8.9e9, "mem_gib": 40.0, "estimated_gib": 41.0,
         "resident_gib": 0.0, "left_gib": 0.0, "profile": None, "error": None}  # fmt: skip
    row = train.train_row(r, "cuda", peak=989.4, roof=795.0)
    assert row["mfu"] == pytest.approx(445.0 / 989.4) and row["mfu_vs_matmul"] == pytest.approx(445.0 / 795.0)
    assert row["mfu"] < 0.45 < row["mfu_vs_matmul"]  # the goal is judged on the first (the field's MFU)
    assert row["mfu_full_square"] == pytest.approx(480.0 / 989.4)  # Megatron-LM's convention, beside it
    cpu = train.train_row(r, "cpu", peak=None, roof=0.002)
    assert cpu["mfu"] is None and cpu["mfu_vs_matmul"] is None and cpu["tokens_per_s"] == 5e4
    assert cpu["mfu_full_square"] is None


def test_overlap_rows_differ_only_by_the_overlap_flags():
    without, with_overlap = train.VARIANTS["dist-opt"], train.VARIANTS["dist-opt+overlap"]
    assert "--use-distributed-optimizer" in without
    assert with_overlap == (*without, *train.OVERLAP_ARGS) and "--overlap-grad-reduce" in train.OVERLAP_ARGS
    assert "DP=1" in train.VARIANT_NOTE


def _fake_runs(monkeypatch, tokens_per_s):
    """train_step.run_one replaced: tokens/s by the flags of the run; the calls recorded in order."""
    from benchmarks import train_step

    calls = []

    def run_one(preset, seq, opts, device):
        flags = tuple(opts.extra_args)
        calls.append((preset, flags))
        tps = tokens_per_s(flags)
        return {"preset": preset, "seq": seq, "layers": opts.num_layers, "mbs": 1, "microbatches": 1,
                "backend": "sdpa", "tokens_per_s": tps, "tflops": 1.0, "tflops_full_square": 1.1,
                "flops_per_token": 1.0, "mem_gib": None, "estimated_gib": 0.0, "resident_gib": None,
                "left_gib": None, "profile": None, "step_s": 64 / tps, "optimizer_s": None,
                "error": None}  # fmt: skip

    monkeypatch.setattr(train_step, "run_one", run_one)
    return calls


def test_the_lever_matrix_times_each_off_twin_then_its_on_run_once(monkeypatch, tmp_path):
    from benchmarks.campaign.part import Part
    from benchmarks.campaign.plan import SMOKE_PLAN

    calls = _fake_runs(monkeypatch, lambda flags: 200.0 if "fused" in flags else 100.0)
    part = Part(tmp_path / "p.json")
    a = argparse.Namespace(peak=None, roof=None)
    timer = train._Timer(a, part, time.monotonic() + 60, SMOKE_PLAN, "cpu", 2, False)
    timer.run({"model": "diff-tiny", "impl": "sdpa", "seq": 64, "variant": None}, "diff-tiny",
              ("--diff-attn-backend", "sdpa"))  # fmt: skip
    train.lever_matrix(timer, SMOKE_PLAN, 64)
    levers = {row["lever"]: row for row in part.data["levers"]}
    assert list(levers) == [lever.name for lever in SMOKE_PLAN.train_levers]
    assert levers["fused optimizer"]["gain"] == pytest.approx(2.0)
    assert levers["chunked loss"]["gain"] == pytest.approx(1.0) and levers["chunked loss"]["note"]
    # every flag set ran once, in the matrix's order: a twin timed before (the sdpa row) is reused
    assert len(calls) == len(set(calls))
    for lever in SMOKE_PLAN.train_levers:
        off, on = calls.index(("diff-tiny", lever.off)), calls.index(("diff-tiny", lever.on))
        assert off < on
    assert calls[0] == ("diff-tiny", ("--diff-attn-backend", "sdpa"))
    assert len(part.data["train"]) == len(calls)  # a row per run, none for reused twins
    assert all(row["variant"].endswith((": on", ": off")) for row in part.data["train"][1:])


def test_levers_differ_from_their_twins_by_their_own_flags_only():
    from benchmarks.campaign import plan

    for lever in plan.GPU_PLAN.train_levers + plan.SMOKE_PLAN.train_levers:
        assert lever.on != lever.off and lever.arch in ("diff", "transformer")
    by_name = {lever.name: lever for lever in plan.GPU_PLAN.train_levers}
    overlap = by_name["overlapped communication"]
    assert overlap.on == (*overlap.off, *train.OVERLAP_ARGS)
    assert by_name["chunked loss"].on[-2:] == ("--cross-entropy-chunk-size", "1024")
    assert plan.GPU_PLAN.train_full_depth.microbatches >= 16 and plan.SMOKE_PLAN.train_full_depth is None


def test_full_depth_is_fitted_over_its_cuts_where_it_does_not_fit():
    from benchmarks.campaign.plan import GPU_PLAN

    full = GPU_PLAN.train_full_depth
    tokens = 16 * 4096
    measured = [
        (4, {"step_s": 1.0, "tokens_per_s": tokens / 1.0}),
        (8, {"step_s": 1.8, "tokens_per_s": tokens / 1.8}),
    ]
    row = train.fitted_row("diff-3b", full, 28, measured)
    assert row["layers"] == 28 and row["impl"] == "fit" and row["variant"] == "fit over 4 and 8 layers"
    assert row["tokens_per_s"] == pytest.approx(tokens / (1.0 + 0.2 * 24))  # 0.2 s a layer


def test_full_depth_runs_its_cuts_amortizes_the_optimizer_and_fits_where_the_model_does_not_fit(
    monkeypatch, tmp_path
):
    from benchmarks.campaign.part import Part
    from benchmarks.campaign.plan import GPU_PLAN

    full = GPU_PLAN.train_full_depth
    layers_seen = []

    calls = _fake_runs(monkeypatch, lambda flags: 1000.0)
    from benchmarks import train_step

    timed = train_step.run_one

    def with_optimizer(preset, seq, opts, device):
        r = timed(preset, seq, opts, device)
        layers_seen.append((preset, opts.num_layers, opts.microbatches, opts.time_optimizer))
        r["step_s"] = 0.5 + 0.1 * opts.num_layers
        r["tokens_per_s"] = 65536 / r["step_s"]
        r["optimizer_s"] = 0.2
        return r

    monkeypatch.setattr(train_step, "run_one", with_optimizer)
    monkeypatch.setattr(
        train, "_fits", lambda plan, preset, full, layers, device: preset.startswith("transformer")
    )
    part = Part(tmp_path / "p.json")
    a = argparse.Namespace(peak=None, roof=None)
    timer = train._Timer(a, part, time.monotonic() + 60, GPU_PLAN, "cuda", 8, False)
    train.full_depth(timer, full)
    assert layers_seen == [
        ("transformer-3b", 28, 16, True),
        ("diff-3b", 4, 16, True),
        ("diff-3b", 8, 16, True),
    ]
    assert len(calls) == 3
    rows = part.data["train"]
    first = rows[0]
    assert first["impl"] == "full-depth" and first["amortize_dp"] == 64
    assert first["tokens_per_s_amortized"] == pytest.approx(65536 / (3.3 - 0.2 + 0.2 / 64))
    fit = rows[-1]
    assert fit["impl"] == "fit" and fit["layers"] == 28
    assert fit["tokens_per_s"] == pytest.approx(65536 / (0.5 + 0.1 * 28))


def test_every_lever_of_the_gpu_plan_is_a_run_the_arguments_accept(monkeypatch):
    """A mistyped or refused flag in the lever matrix fails here, not on a lent GPU's clock: each lever's
    on and off flags resolve (bf16, as the GPU runs) for its model's tiny twin, on a machine with FP8, CUDA
    graphs, cuDNN attention and CUDA's fp32-output addmm (the grad-accum fusion): an H100."""
    from benchmarks.campaign import plan
    from diffmeg.fusions import grad_accum, torchao_fp8
    from diffmeg.kernels import sdpa_backends
    from diffmeg.training import graphs
    from diffmeg.training.arguments import resolve_args

    monkeypatch.setattr(torchao_fp8, "fp8_unsupported_reason", lambda emulate=False: None)  # as on an H100
    monkeypatch.setattr(graphs, "cuda_graphs_unsupported_reason", lambda: None)
    monkeypatch.setattr(sdpa_backends, "unsupported_reason", lambda name: None)
    monkeypatch.setattr(grad_accum, "unsupported_reason", lambda: None)

    models = {"diff": "diff-tiny", "transformer": "transformer-tiny"}
    names = [lever.name for lever in plan.GPU_PLAN.train_levers]
    assert len(names) == len(set(names))
    assert {
        "every fused op (diff)",
        "every fused op (transformer)",
        "FP8 on the fast path (transformer)",
        *(f"{name} ({arch})" for name, _ in plan.GRAPH_OPS for arch in ("diff", "transformer")),
        "grad-accum fusion (diff)",
        "grad-accum fusion (transformer)",
    } <= set(names)
    for lever in plan.GPU_PLAN.train_levers:
        for flags in (lever.on, lever.off):
            args = resolve_args(["--model", models[lever.arch], "--bf16", *flags], world_size=1)
            assert args.bf16, lever.name


def test_docs_gpu_md_states_the_lever_count_of_the_gpu_plan():
    """docs/gpu.md's lever count is the plan's, not a number typed once and left behind."""
    import re

    from benchmarks.campaign import plan

    text = (Path(__file__).resolve().parents[3] / "docs" / "gpu.md").read_text()
    stated = re.search(r"grown from 6 to (\d+) levers", text)
    assert stated is not None and int(stated.group(1)) == len(plan.GPU_PLAN.train_levers)


def test_the_headline_levers_run_first():
    """A command cut by its budget has measured what the goals are judged on: the fast path against
    today's on both models, then FP8 on it; the other levers keep their order after them."""
    from benchmarks.campaign import plan

    names = [lever.name for lever in plan.GPU_PLAN.train_levers]
    assert names[:4] == [
        "every fused op (diff)",
        "every fused op (transformer)",
        "FP8 on the fast path (diff)",
        "FP8 on the fast path (transformer)",
    ]
    assert names.index("attention sdpa_split_v_batched vs sdpa") < names.index("chunked loss")
    assert names.index("chunked loss") < names.index("torch norm (diff)")
    assert names.index("cuDNN attention first (diff)") < names.index("torch norm (transformer)")
    runs = train.planned_runs(plan.GPU_PLAN)
    first_lever = next(i for i, row in enumerate(runs) if row["impl"] == "lever")
    assert runs[first_lever]["variant"] == "every fused op (diff): on"  # its off twin: the sdpa row above


def test_plan_prints_the_train_runs_and_docs_gpu_md_cites_their_count(capsys):
    """`python3 -m benchmarks.campaign --plan` counts the train runs (twins timed once); docs/gpu.md's
    command plan cites that count, not a hand count."""
    import re

    from benchmarks.campaign import plan, runner

    runs = train.planned_runs(plan.GPU_PLAN)
    assert len({(r["model"], r["seq"], tuple(r["flags"]), r["layers"]) for r in runs}) == len(runs)
    assert len(train.planned_runs(plan.GPU_PLAN, full_depth_fits=False)) == len(runs) + 2  # two cuts a model
    assert runner.main(["--plan"]) == 0
    printed = capsys.readouterr().out
    assert f"\n{len(runs)} train runs: " in printed and "estimate: 23.4 s a run" in printed
    text = (Path(__file__).resolve().parents[3] / "docs" / "gpu.md").read_text()
    stated = re.search(r"the GPU plan has (\d+) train runs", text)
    assert stated is not None and int(stated.group(1)) == len(runs)
