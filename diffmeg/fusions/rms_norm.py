"""RMSNorm in fp32: the blocks' norm of the local (non-TE) spec, usable with sequence parallelism, and
DIFF V1's per-head norm.

`rms_norm` is today's eager math and the reference of the fused variant beside it, `rms_norm_torch`
(torch's `F.rms_norm`, one fused kernel on CUDA, the eager ops' composite on CPU), both entries of
`diffmeg.registry`'s `norm` slot (`--norm-impl`). The module classes differ only in the function they
call, so checkpoints and the sequence-parallel weight tagging are the same for both.

A fused residual-add + norm is not offered: megatron-core 0.16.1's `TransformerLayer` adds the residual in
its bias-dropout-add (`self_attn_bda` / `mlp_bda`) and calls `pre_mlp_layernorm` / the next layer's
`input_layernorm` as separate submodules on separate tensors; fusing them would mean rewriting its
`_forward_attention` / `_forward_mlp` rather than choosing a submodule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""An RMSNorm over the last dim: (x, weight, eps) -> normed x in x's dtype."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in (at least) fp32 and returned in x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.to(dtype)).to(x.dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` through torch's `F.rms_norm`, which accumulates in fp32 (or wider) itself: on CUDA one
    kernel reads x once, with no fp32 copy of x in memory."""
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


class RMSNorm(torch.nn.Module):
    """Layer norm with megatron-core's norm signature.

    megatron-core's `WrappedTorchNorm` refuses sequence parallelism. Under SP each TP rank normalises
    a different slice of the sequence, so the weight's gradient is partial: tagging it
    `sequence_parallel` makes megatron-core's `finalize_model_grads` sum it over the TP group.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__()
        self.eps = eps
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else "cuda"
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = config.sequence_parallel

    norm_fn: NormFn = staticmethod(rms_norm)
    """The function that normalises (a subclass per implementation of the registry's `norm` slot)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight, self.eps)


class TorchRMSNorm(RMSNorm):
    """`RMSNorm` through torch's `F.rms_norm` (the registry's `norm` entry `torch`)."""

    norm_fn = staticmethod(rms_norm_torch)


class HeadRMSNorm(torch.nn.Module):
    """RMSNorm of each differential head's 2d-wide output; one weight shared by all heads of the layer.

    The weight is replicated over tensor-parallel ranks that each see their own heads: the attention that
    owns it tags it for the TP gradient sum (`diffmeg.collectives.SUM_GRAD_OVER_TP_ATTR`).
    """

    def __init__(
        self, width: int, eps: float, dtype: torch.dtype | None = None, norm_fn: NormFn = rms_norm
    ) -> None:
        """`norm_fn`: the `norm_fn` of the registry's chosen `norm` class (the eager math by default)."""
        super().__init__()
        self.eps = eps
        self.norm_fn = norm_fn
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight, self.eps)
