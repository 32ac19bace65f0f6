"""Small results objects for the report and campaign tests (numbers made up, never published)."""

from __future__ import annotations

from benchmarks.campaign import schema


def gpu_result(date: str = "2026-12-01T10:00:00+00:00", speedup: float = 1.35) -> dict:
    """A GPU results file as the first H100 runs wrote them: the retired fused Triton kernel's rows and keys
    (`schema.RETIRED_TOP_LEVEL`) included, which report.py renders as history."""
    r = schema.empty_result()
    r.update(
        date=date,
        device="NVIDIA H100 80GB HBM3",
        device_type="cuda",
        git_revision="0123456789abcdef",
        git_dirty=False,
        smoke=False,
        machine={"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.1},
        versions={"torch": "2.11.0"},
        bf16_matmul_tflops=781.5,
        peak_bf16_tflops=989.4,
        tests={
            "passed": 40,
            "failed": 1,
            "errors": 0,
            "skipped": 3,
            "failures": ["t::x"],
            "timed_out": False,
        },
        fused_speedup_vs_best_unfused_4k=speedup,
        diff_vs_transformer_ratio_4k=0.941,
        flop_bound_4k=0.9561,
        flop_bound_3b_4k=0.9561,
    )
    r["phases"]["env"] = {"status": "ok", "seconds": 12.0, "error": None}
    r["phases"]["kernels"] = {
        "status": "partial",
        "seconds": 290.0,
        "error": "some rows skipped: time budget",
    }

    def attn(impl, fwd, bwd, tflops, correct=True, error=None):
        return {"impl": impl, "seq": 4096, "batch": 1, "heads": 12, "kv_heads": 12, "head_dim": 128,
                "fwd_ms": fwd, "bwd_ms": bwd, "fwd_bwd_ms": None if fwd is None else fwd + bwd,
                "tflops": tflops, "vs_baseline": None, "correct": correct, "error": error}  # fmt: skip

    r["attention"] = [
        attn("baseline sdpa", 1.0, 2.0, 333.0, None),
        attn("diff sdpa split-v", 2.0, 4.5, 231.0),
        attn("diff triton f64x16s2w4 kv16x128 q128x16 w8", 1.5, 3.3, 312.5),
        attn("diff triton f128x64s2w8 kv32x128 q128x32 w8", None, None, None, None, "OutOfResources: smem"),
    ]
    r["triton_candidates"] = [
        {"label": "f64x16s2w4 kv16x128 q128x16 w8", "config": {}, "correct": True, "max_rel_err": 4e-3,
         "torch_rel_err": 3e-3, "error": None},
    ]  # fmt: skip
    r["triton_best"] = {"label": "f64x16s2w4 kv16x128 q128x16 w8", "head_dim": 128, "config": {}}
    r["train"] = [
        {"model": "transformer-3b", "impl": "baseline", "arch": "transformer", "seq": 4096, "layers": 8,
         "tokens_per_s": 51234.0, "mfu": 0.472, "mem_gib": 40.0, "estimated_gib": 41.0, "error": None},
        {"model": "diff-3b", "impl": "triton", "arch": "diff", "seq": 4096, "layers": 8,
         "tokens_per_s": 48211.0, "mfu": 0.466, "mem_gib": 41.0, "estimated_gib": 42.0, "error": None,
         "resident_gib": 0.0, "left_gib": 0.0,
         "profile": {"total_ms": 512.5, "top": [["nvjet_tst_256x128", 300.0, 0.585]],
                     "share": {"matmul": 0.585, "attention": 0.25, "loss": 0.04, "optimizer": 0.03,
                               "communication": 0.0, "other": 0.095}}},
    ]  # fmt: skip
    r["memory"] = [
        {"layout": "diff-3b 4L s4096 mbs2 recompute=none", "estimated_gib": 30.0, "measured_gib": 28.5,
         "error": None},
    ]  # fmt: skip
    r["gpu_train_run"] = [
        {"model": "diff-tiny", "iterations": 50, "loss_first": 11.61, "loss_last": 6.02, "loss_falls": True,
         "resume_exact": True, "resume_max_abs_diff": 0.0, "generation_ok": True, "error": None},
    ]  # fmt: skip
    assert schema.validate(r) == [], schema.validate(r)
    return r


def cpu_smoke_result() -> dict:
    r = schema.empty_result()
    r.update(date="2026-12-02T00:00:00+00:00", device="cpu (x86_64)", device_type="cpu", git_revision="feed",
             smoke=True, bf16_matmul_tflops=0.000123)  # fmt: skip
    r["train"] = [{"model": "diff-tiny", "impl": "sdpa", "arch": "diff", "seq": 64, "tokens_per_s": 987.6,
                   "mfu": None, "error": None}]  # fmt: skip
    assert schema.validate(r) == []
    return r
