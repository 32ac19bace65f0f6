"""Gradient-accumulation fusion without apex (`--gradient-accumulation-fusion`).

megatron-core's `ColumnParallelLinear` and `RowParallelLinear` can add each weight gradient straight into
`weight.main_grad`, megatron-core DDP's fp32 gradient buffer (`config.gradient_accumulation_fusion`): one
GEMM that accumulates in fp32, instead of a bf16 `grad_weight` the size of the weight, which DDP's hook then
adds to `main_grad` with a second kernel. megatron-core calls apex's CUDA extension for it, which the GPU
machine lacks; this module is that extension's two functions over torch ops, and `install()` hands them to
megatron-core (the patch itself is `diffmeg.compat.grad_accum`, beside the other megatron-core patches).

- CUDA, bf16/fp16 operands: torch's fp32-output GEMM (`aten::addmm.dtype_out`, torch >= 2.8) multiplies the
  half-precision operands and accumulates into the fp32 `main_grad` in place;
- fp32 operands (an fp32 run): the same-dtype in-place `addmm_`;
- CPU: torch has no dtype-out addmm there, so a reference path upcasts the operands to fp32 (exact) and
  accumulates with `addmm_`: the same sum up to summation order. It exists so the CPU tests run the whole
  integration; training on CPU refuses the flag unless a test sets `CPU_TEST_ENV`.
"""

from __future__ import annotations

import os
import sys

import torch

from diffmeg.compat.grad_accum import apex_grad_accum_available, grad_accum_patched, patch_grad_accum_fusion
from diffmeg.errors import DiffmegError

CPU_TEST_ENV = "DIFFMEG_TEST_GRAD_ACCUM_FUSION_ON_CPU"
"""Set to 1 by tests only: accept the flag without CUDA, through the CPU reference path (no speed-up)."""


def _check(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's contract: 2-D operands [tokens, in] and [tokens, out] of one dtype, main_grad [out, in]."""
    if total_input.dim() != 2 or grad_output.dim() != 2:
        raise ValueError(f"2-D operands expected, got {tuple(total_input.shape)}, {tuple(grad_output.shape)}")
    if total_input.dtype != grad_output.dtype:
        raise ValueError(f"operands of one dtype expected, got {total_input.dtype}, {grad_output.dtype}")
    expected = (grad_output.shape[1], total_input.shape[1])
    if tuple(main_grad.shape) != expected or grad_output.shape[0] != total_input.shape[0]:
        raise ValueError(
            f"main_grad {tuple(main_grad.shape)} is not grad_output^T @ total_input: "
            f"{tuple(grad_output.shape)}^T @ {tuple(total_input.shape)}"
        )


def wgrad_gemm_accum_fp32(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """`main_grad += grad_output^T @ total_input` into an fp32 `main_grad` [out, in], in one GEMM.

    megatron-core passes its activations flattened seq-first, [s, b, in] -> [s * b, in], and the output
    gradient likewise, [s * b, out]."""
    _check(total_input, grad_output, main_grad)
    if main_grad.dtype != torch.float32:
        raise ValueError(f"wgrad_gemm_accum_fp32 accumulates into fp32, got main_grad {main_grad.dtype}")
    grad_t = grad_output.t()  # [out, tokens]
    if total_input.dtype == torch.float32:
        main_grad.addmm_(grad_t, total_input)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_t, total_input, out_dtype=torch.float32, out=main_grad)
    else:  # the CPU reference: bf16/fp16 -> fp32 is exact, the products accumulate in fp32 as on CUDA
        main_grad.addmm_(grad_t.float(), total_input.float())


def wgrad_gemm_accum_fp16(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """`main_grad += grad_output^T @ total_input` for a bf16/fp16 `main_grad` (DDP without
    `grad_reduce_in_fp32`): operands and buffer share the dtype, so the plain in-place `addmm_` is it."""
    _check(total_input, grad_output, main_grad)
    if main_grad.dtype not in (torch.float16, torch.bfloat16) or total_input.dtype != main_grad.dtype:
        raise ValueError(
            "wgrad_gemm_accum_fp16 needs a bf16/fp16 main_grad of the operands' dtype, got "
            f"{main_grad.dtype} and {total_input.dtype}"
        )
    main_grad.addmm_(grad_output.t(), total_input)  # [out, tokens] @ [tokens, in]


def _dtype_out_addmm_on_cuda() -> bool:
    """This torch registers a CUDA kernel for `aten::addmm.dtype_out`."""
    if "dtype_out" not in torch.ops.aten.addmm.overloads():
        return False
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    return has_kernel is None or bool(has_kernel("aten::addmm.dtype_out", "CUDA"))


_FLAG = "--gradient-accumulation-fusion"
_NEWER_TORCH = "use a newer torch or leave out the flag"


def unsupported_reason() -> str | None:
    """Why our gradient-accumulation fusion cannot run on this machine, in one line with the fix; None when
    it can. Touches no GPU (the flags are checked before a rank picks its device); `install()` then tries
    the GEMM once. torchao's FP8 linears refuse the fusion themselves (`diffmeg.fusions.torchao_fp8`)."""
    if apex_grad_accum_available():
        return None  # megatron-core uses apex's extension as it is
    if not torch.cuda.is_available():
        if os.environ.get(CPU_TEST_ENV) == "1":
            return None
        return f"{_FLAG} needs a CUDA GPU (its fp32-output GEMM is CUDA's; a CPU has no gain): leave it out"
    if not _dtype_out_addmm_on_cuda():
        lacks = f"torch {torch.__version__} lacks"
        return f"{_FLAG} needs torch's fp32-output addmm on CUDA (torch 2.8+), which {lacks}: {_NEWER_TORCH}"
    return None


def _cuda_gemm_refusal() -> str | None:
    """Why this torch's dtype-out addmm cannot add bf16 products into an fp32 buffer in place on this GPU
    (None: it can). Early kernels wanted the addend in the operands' dtype, so one tiny call settles it."""
    a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
    acc = torch.ones(2, 2, dtype=torch.float32, device="cuda")
    version = torch.__version__
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except RuntimeError as exc:
        why = str(exc).splitlines()[0]
        return (
            f"{_FLAG}: torch {version}'s fp32-output addmm refuses an fp32 main_grad ({why}): {_NEWER_TORCH}"
        )
    if not torch.equal(acc, torch.full_like(acc, 3.0)):
        return f"{_FLAG}: torch {version}'s fp32-output addmm does not accumulate in place: {_NEWER_TORCH}"
    return None


def install() -> bool:
    """Let megatron-core's linears fuse gradient accumulation: with apex's extension where it is installed
    (returns False, nothing changed), else with this module's functions (returns True). Refuses in one line
    where neither can run. Called by `diffmeg.model.build_model` before the first linear is built."""
    if apex_grad_accum_available():
        return False
    reason = unsupported_reason()
    if reason is None and torch.cuda.is_available() and not grad_accum_patched():
        reason = _cuda_gemm_refusal()  # once a process
    if reason is not None:
        raise DiffmegError(reason)
    return patch_grad_accum_fusion(sys.modules[__name__])
