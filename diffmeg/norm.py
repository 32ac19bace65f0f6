"""RMSNorm in fp32 for the local (non-TE) spec, usable with sequence parallelism."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in (at least) fp32 and returned in x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.to(dtype)).to(x.dtype)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
