"""benchmarks/step_profile.py: kernels and operators sorted into kinds, shares that add up, a real profile."""

from __future__ import annotations

import pytest
import torch

from benchmarks import step_profile


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT", "matmul"),  # cuBLAS's Hopper GEMMs
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
        ("aten::addmm", "matmul"),
        ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("triton_tem_fused_flex_attention_0", "attention"),  # FlexAttention, compiled
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("_VocabParallelCrossEntropy", "loss"),
        ("multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>", "optimizer"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"),
        ("triton_poi_fused_mul_silu_0", "other"),  # a compiled SwiGLU
        ("aten::commit", "other"),  # "mm" inside a word is no matmul
    ],
)
def test_kinds_by_name(name, kind):
    assert step_profile.kind_of(name) == kind


def test_shares_add_up_and_the_top_is_sorted():
    times = {"nvjet_a": 600.0, "flash_fwd": 250.0, "triton_poi_fused_add": 100.0, "ncclAllReduce": 50.0}
    s = step_profile.summarize(times)
    assert s["total_ms"] == pytest.approx(1.0)
    assert s["share"]["matmul"] == pytest.approx(0.6) and s["share"]["attention"] == pytest.approx(0.25)
    assert s["share"]["communication"] == pytest.approx(0.05) and s["share"]["optimizer"] == 0.0
    assert sum(s["share"].values()) == pytest.approx(1.0) and list(s["share"]) == list(step_profile.KINDS)
    assert [row[0] for row in s["top"]] == ["nvjet_a", "flash_fwd", "triton_poi_fused_add", "ncclAllReduce"]
    assert s["top"][0][1:] == [pytest.approx(0.6), pytest.approx(0.6)]
    assert "matmul 60% attention 25% communication 5% other 10%" in step_profile.format_share(s)


def test_a_matmul_step_on_the_cpu_records_its_operators_and_shares_that_add_up():
    """Which operators ran and how the shares are formed, not how long each took (a loaded machine moves
    the times); the matmul share is printed as a benchmark figure (pytest -s)."""
    a = torch.randn(384, 384)

    def step():
        for _ in range(4):
            (a @ a).relu_()

    s = step_profile.profile_step(step, "cpu")
    kinds = {step_profile.kind_of(name) for name, _, _ in s["top"]}
    assert "matmul" in kinds and "other" in kinds, s["top"]  # the matmuls and the in-place relu
    assert any("relu" in name for name, _, _ in s["top"]), s["top"]
    assert list(s["share"]) == list(step_profile.KINDS) and sum(s["share"].values()) == pytest.approx(1.0)
    assert all(0 <= share <= 1 for share in s["share"].values())
    assert s["share"]["attention"] == s["share"]["communication"] == 0.0  # none of those ran
    print(f"cpu matmul step: {step_profile.format_share(s)}")


def test_the_profile_records_busy_time_and_the_sdpa_backend_per_shape():
    q = torch.randn(1, 2, 16, 8)

    def step():
        for _ in range(3):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        (q.flatten(0, 2) @ q.flatten(0, 2).T).sum()

    s = step_profile.profile_step(step, "cpu")
    assert 0 < s["busy"] <= 1.5 and s["busy_basis"].startswith("cpu"), s
    chosen = {r["backend"]: r for r in s["sdpa"]}
    assert set(chosen) <= set(step_profile.SDPA_OPS.values()) and chosen, s["sdpa"]
    (row,) = s["sdpa"]
    assert row["q_shape"] == [1, 2, 16, 8] and row["calls"] == 3
    assert s["cudnn"] is None or isinstance(s["cudnn"], int)
    assert "busy" in step_profile.format_share(s)
