"""Gradient-accumulation fusion without apex (`diffmeg.fusions.grad_accum`): the accumulation against its
equation in float64, the CUDA GEMM on a GPU, the patch of megatron-core, and each one-line refusal."""

from __future__ import annotations

import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.fusions import grad_accum

TOKENS, IN, OUT = 24, 16, 12  # a [s=6, b=4] micro-batch flattened seq-first, as megatron-core passes it


def _operands(dtype: torch.dtype, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, IN, generator=gen).to(device, dtype)  # total_input [s * b, in]
    g = torch.randn(TOKENS, OUT, generator=gen).to(device, dtype)  # grad_output [s * b, out]
    return x, g


def _equation(main_grad: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """main_grad_after = main_grad_before + sum_k g_k^T x_k, in float64 from the operands' exact values."""
    expected = main_grad.double().cpu()
    for x, g in pairs:
        expected = expected + g.double().cpu().t() @ x.double().cpu()
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp32_accumulation_is_the_equation_and_repeated_calls_add_up(dtype):
    """Three calls (three micro-batches) into one fp32 buffer that starts non-zero: fp32 rounding of the
    float64 sum. bf16/fp16 operands take the CPU reference path (upcast), fp32 ones the in-place addmm_."""
    main_grad = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0))
    storage = main_grad.data_ptr()
    pairs = [_operands(dtype, seed) for seed in (1, 2, 3)]
    expected = _equation(main_grad, pairs)
    after_one = _equation(main_grad, pairs[:1])
    for k, (x, g) in enumerate(pairs):
        grad_accum.wgrad_gemm_accum_fp32(x, g, main_grad)
        if k == 0:
            torch.testing.assert_close(main_grad.double(), after_one, rtol=1e-6, atol=1e-5)
    assert main_grad.dtype == torch.float32 and main_grad.data_ptr() == storage  # in place
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-6, atol=1e-5)
    assert not torch.allclose(main_grad.double(), after_one, atol=1e-2)  # the later calls did add


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulation_is_the_equation_to_its_rounding(dtype):
    main_grad = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).to(dtype)
    pairs = [_operands(dtype, seed) for seed in (1, 2)]
    expected = _equation(main_grad, pairs)
    for x, g in pairs:
        grad_accum.wgrad_gemm_accum_fp16(x, g, main_grad)
    assert main_grad.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(main_grad.double(), expected, rtol=tol, atol=tol * 8)


def test_operands_outside_apexs_contract_are_refused():
    x, g = _operands(torch.bfloat16, 1)
    with pytest.raises(ValueError, match="accumulates into fp32"):
        grad_accum.wgrad_gemm_accum_fp32(x, g, torch.zeros(OUT, IN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="is not grad_output"):
        grad_accum.wgrad_gemm_accum_fp32(x, g, torch.zeros(IN, OUT))
    with pytest.raises(ValueError, match="2-D operands"):
        grad_accum.wgrad_gemm_accum_fp32(x.view(6, 4, IN), g.view(6, 4, OUT), torch.zeros(OUT, IN))
    with pytest.raises(ValueError, match="bf16/fp16 main_grad"):
        grad_accum.wgrad_gemm_accum_fp16(x, g, torch.zeros(OUT, IN))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output addmm is CUDA's (needs a GPU)")
def test_cuda_dtype_out_gemm_accumulates_bf16_products_in_fp32():
    """The real path: bf16 operands, torch's dtype-out addmm writing the fp32 buffer in place."""
    assert grad_accum.unsupported_reason() is None and grad_accum._cuda_gemm_refusal() is None
    main_grad = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).cuda()
    storage = main_grad.data_ptr()
    pairs = [_operands(torch.bfloat16, seed, "cuda") for seed in (1, 2, 3)]
    expected = _equation(main_grad, pairs)
    for x, g in pairs:
        grad_accum.wgrad_gemm_accum_fp32(x, g, main_grad)
    assert main_grad.dtype == torch.float32 and main_grad.data_ptr() == storage
    torch.testing.assert_close(main_grad.double().cpu(), expected, rtol=1e-5, atol=1e-4)
    # unfused, each micro-batch's product is a bf16 grad_weight before DDP's fp32 add: further from the sum
    unfused = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).cuda()
    for x, g in pairs:
        unfused += g.t() @ x  # [out, in] in bf16
    error, unfused_error = ((t.double().cpu() - expected).abs().max() for t in (main_grad, unfused))
    assert error < unfused_error


def test_install_points_megatron_cores_linears_at_ours(single_rank_parallel_state, monkeypatch):
    import megatron.core.tensor_parallel.layers as layers

    monkeypatch.setenv(grad_accum.CPU_TEST_ENV, "1")
    assert grad_accum.install() is True and grad_accum.install() is True  # idempotent
    assert layers._grad_accum_fusion_available and layers.fused_weight_gradient_mlp_cuda is grad_accum
    import fused_weight_gradient_mlp_cuda  # what megatron-core's utils.py imports inside its function

    assert fused_weight_gradient_mlp_cuda is grad_accum


def test_on_cpu_the_flag_is_refused_without_the_test_hook(single_rank_parallel_state, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal")
    monkeypatch.delenv(grad_accum.CPU_TEST_ENV, raising=False)
    with pytest.raises(DiffmegError, match="needs a CUDA GPU .*: leave it out$"):
        grad_accum.install()


def test_a_torch_without_cuda_dtype_out_addmm_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(grad_accum, "_dtype_out_addmm_on_cuda", lambda: False)
    reason = grad_accum.unsupported_reason()
    assert reason is not None and "fp32-output addmm on CUDA (torch 2.8+)" in reason
    assert reason.endswith("use a newer torch or leave out the flag")
    with pytest.raises(DiffmegError, match="fp32-output addmm on CUDA"):
        grad_accum.install()


def test_torchao_fp8_refuses_the_fusion_in_one_place():
    pytest.importorskip("torchao.float8")
    from diffmeg.fusions import torchao_fp8
    from tests.builders import tiny_config

    with pytest.raises(DiffmegError, match="write weight.grad, not main_grad: leave out --gradient-accum"):
        torchao_fp8.check_fp8("tensorwise", None, None, True, emulate=True)
    torchao_fp8.check_fp8("tensorwise", None, None, False, emulate=True)
    config = tiny_config(
        2, 2, 8, fp8="hybrid", fp8_recipe="tensorwise", fp8_emulate=True, gradient_accumulation_fusion=True
    )
    with pytest.raises(DiffmegError, match="write weight.grad, not main_grad"):
        torchao_fp8.TorchaoFp8(config)
