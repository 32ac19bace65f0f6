"""benchmarks/campaign/train_plan.py: what the train phase compares, in the order the goals need it, and
every variant a run the arguments accept (a refused flag fails here, not on a lent GPU's clock)."""

from __future__ import annotations

from benchmarks.campaign import plan, train_plan


def _names(p=plan.GPU_PLAN) -> list[str]:
    return [c.name for c in train_plan.comparisons(p)]


def test_the_goals_come_first_then_the_other_length_then_the_leave_one_out_runs():
    comps = train_plan.comparisons(plan.GPU_PLAN)
    names = _names()
    assert names[:3] == [
        "fast path vs defaults (transformer) s4096",
        "DIFF V1 / Transformer (fast path) s4096",
        "fast path vs defaults (diff) s4096",
    ]
    first = [c for c in comps if c.on.seq == 4096 and c.group != "leave-one-out"]
    assert names[: len(first)] == [c.name for c in first]  # every 4K goal before any 2K row
    assert {"fast path vs defaults (diff2) s4096", "FP8 on the fast path (diff) s4096",
            "FP8 on the fast path (transformer) s4096", "attention sdpa_split_v_batched vs sdpa (diff) s4096",
            "attention sdpa_split_v vs sdpa (diff) s4096"} <= {c.name for c in first}  # fmt: skip
    later = [c.group for c in comps[len(first) :]]
    assert later == sorted(later, key=("other lengths", "leave-one-out").index)  # 2K, then leave-one-out
    assert all(c.on.seq == 2048 for c in comps if c.group == "other lengths")
    assert len(names) == len(set(names))


def test_the_fast_path_holds_every_lever_and_its_defaults_none():
    comps = {c.name: c for c in train_plan.comparisons(plan.GPU_PLAN)}
    headline = comps["fast path vs defaults (transformer) s4096"]
    assert headline.off.flags == () and headline.off.label == "defaults"
    fast = set(headline.on.flags)
    for flags in ("--sdpa-backend", "--compile-layers", "--cross-entropy-loss-fusion", "--norm-impl",
                  "--optimizer-impl", "--gradient-accumulation-fusion"):  # fmt: skip
        assert flags in fast
    assert "--cuda-graph-impl" not in fast  # excludes the compiled layers: a comparison of its own
    graphs = comps["CUDA graphs in place of compiled layers (diff) s4096"]
    assert "--cuda-graph-impl" in graphs.on.flags and "--compile-layers" not in graphs.on.flags


def test_fp8_is_timed_against_the_fast_path_without_the_grad_accum_fusion():
    """torchao's FP8 refuses the grad-accum fusion: its twin is the fast path without it, which is itself
    timed against the fast path (that lever's share), and the row says so."""
    comps = {c.name: c for c in train_plan.comparisons(plan.GPU_PLAN)}
    for arch in ("diff", "transformer"):
        fp8 = comps[f"FP8 on the fast path ({arch}) s4096"]
        assert "--gradient-accumulation-fusion" not in fp8.off.flags + fp8.on.flags
        assert fp8.on.flags == (*fp8.off.flags, *plan.GPU_PLAN.train_fp8) and "grad-accum" in fp8.note
        share = comps[f"grad-accum fusion, leave-one-out ({arch}) s4096"]
        assert share.off.key == fp8.off.key and share.on.flags == (
            *share.off.flags,
            "--gradient-accumulation-fusion",
        )
    for c in comps.values():
        for v in (c.on, c.off):
            assert not ("--fp8-format" in v.flags and "--gradient-accumulation-fusion" in v.flags), v


def test_each_leave_one_out_run_lacks_exactly_its_lever():
    fast = dict(plan.GPU_PLAN.train_fast)
    for c in train_plan.comparisons(plan.GPU_PLAN):
        if c.name.startswith(tuple(f"{name}, leave-one-out" for name in fast)):
            lever = c.name.split(",")[0]
            assert [f for f in c.on.flags if f not in c.off.flags] == list(fast[lever])
            assert c.on.label == "fast path" and c.off.model == c.on.model


def test_the_smoke_plan_is_the_gpu_plans_start_on_what_a_cpu_runs():
    names = _names(plan.SMOKE_PLAN)
    assert names == [
        "fast path vs defaults (transformer) s64",
        "DIFF V1 / Transformer (fast path) s64",
        "fast path vs defaults (diff) s64",
    ]


def test_every_variant_of_the_gpu_plan_is_a_run_the_arguments_accept(monkeypatch):
    """Each variant's flags resolve (bf16, as the GPU runs) for its model's tiny twin, on a machine with
    FP8, CUDA graphs, cuDNN attention and CUDA's fp32-output addmm: an H100."""
    from diffmeg.fusions import grad_accum, torchao_fp8
    from diffmeg.kernels import sdpa_backends
    from diffmeg.training import graphs
    from diffmeg.training.arguments import resolve_args

    monkeypatch.setattr(torchao_fp8, "fp8_unsupported_reason", lambda emulate=False: None)  # as on an H100
    monkeypatch.setattr(graphs, "cuda_graphs_unsupported_reason", lambda: None)
    monkeypatch.setattr(sdpa_backends, "gpu_unavailable", lambda device_type: None)
    monkeypatch.setattr(grad_accum, "unsupported_reason", lambda: None)
    variants = {v.key: v for c in train_plan.comparisons(plan.GPU_PLAN) for v in (c.on, c.off)}
    for v in variants.values():
        tiny = v.model.rsplit("-", 1)[0] + "-tiny"
        args = resolve_args(["--model", tiny, "--bf16", *v.flags], world_size=1)
        assert args.bf16, v
    for backend in plan.GPU_PLAN.train_backends:  # a backend that left the registry fails here
        resolve_args(["--model", "diff-tiny", "--diff-attn-backend", backend], world_size=1)
