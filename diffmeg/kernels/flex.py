"""Differential attention from FlexAttention: two calls over V of width 2d, combined in fp32.

FlexAttention takes a V wider than q/k, so DIFF needs neither split-V's four calls nor a kernel of its
own: each map is one call over all of V. On a GPU the calls are torch.compile'd (Triton kernels generated
per shape); on a CPU FlexAttention runs forward only (torch has no CPU backward for it), which is how the
tests check its numerics, and training refuses it there. A measured candidate, chosen by name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from diffmeg.fusions.diff_combine import diff_combine


def flex_attention_available() -> bool:
    """True when this torch has FlexAttention (torch.nn.attention.flex_attention, torch >= 2.5)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_unavailable(device_type: str | None) -> str | None:
    """The registry's check of the `flex` backend: this torch has it; training needs CUDA tensors."""
    if not flex_attention_available():
        return "attention backend 'flex' needs torch >= 2.5 (FlexAttention); use 'sdpa'"
    if device_type is not None and device_type != "cuda":
        return "attention backend 'flex' needs a CUDA GPU (FlexAttention has no CPU backward); use 'sdpa'"
    return None


@cache
def _flex(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@cache
def _causal_block_mask(sq: int, sk: int, device: str) -> object:
    """The causal block mask with queries aligned to the end of the keys (a KV-cache step too)."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = sk - sq

    def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx <= q_idx + offset

    return create_block_mask(causal, None, None, sq, sk, device=device)


def diff_attention_flex(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    *,
    scale: float,
    dropout_p: float = 0.0,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `diff_attention_reference`, causal, without attention dropout."""
    if attention_mask is not None or dropout_p > 0.0:
        raise ValueError(
            "the flex backend is causal-only without attention dropout; use the reference backend"
        )
    flex = _flex(compiled=q1.is_cuda)
    mask = _causal_block_mask(q1.shape[-2], k1.shape[-2], str(q1.device))
    gqa = q1.shape[1] != k1.shape[1]
    o1 = flex(q1, k1, v, block_mask=mask, scale=scale, enable_gqa=gqa)  # [b, h, sq, 2d]
    o2 = flex(q2, k2, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return diff_combine(o1, o2, lam)
