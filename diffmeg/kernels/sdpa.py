"""Differential attention from two (or four) fused-attention calls: `A1 V - lam * A2 V`.

torch's SDPA (and flash-attn) compute softmax(QK^T)V without materialising the map, so DIFF costs two
calls that share V. Kernels that need equal q/k/v head sizes (FlashAttention on GPU) get V split into
its two d-wide halves: four calls, same result.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from diffmeg.kernels.reference import causal_keep_mask


def flash_attn_available() -> bool:
    """True when the flash-attn package is importable (GPU builds only)."""
    return importlib.util.find_spec("flash_attn") is not None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float) -> torch.Tensor:
    sq, sk = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if sq == sk:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
        )
    # KV-cache step: queries sit at the end of the keys (SDPA's is_causal aligns them to the start).
    mask = causal_keep_mask(sq, sk, q.device)  # [sq, sk], True = attend
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
    )


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float) -> torch.Tensor:
    from flash_attn import flash_attn_func  # optional GPU dependency

    # flash-attn is [b, s, heads, d] and aligns causal queries to the end of the keys, as we need.
    out = flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=True,
    )
    return out.transpose(1, 2)


class _Combine(torch.autograd.Function):
    """`o1 - lam * o2` computed in fp32 (or wider), as the reference and the fused kernel do.

    In the activation dtype lambda would be rounded to bf16 and its gradient -sum(dO * o2) summed in bf16.
    Autograd of the fp32 expression would save o2 in fp32 (twice the bytes); this keeps o2 as it came.
    """

    @staticmethod
    def forward(ctx, o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(o1.dtype, torch.float32)
        ctx.save_for_backward(o2, lam)
        return (o1.to(wide) - lam.to(wide) * o2.to(wide)).to(o1.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        o2, lam = ctx.saved_tensors
        wide = torch.promote_types(dout.dtype, torch.float32)
        do2 = (-lam.to(wide) * dout.to(wide)).to(o2.dtype) if ctx.needs_input_grad[1] else None
        dlam = None
        if ctx.needs_input_grad[2]:
            dlam = -(dout.to(wide) * o2.to(wide)).sum().to(lam).reshape(lam.shape)
        return (dout if ctx.needs_input_grad[0] else None), do2, dlam


def diff_attention_sdpa(
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
    split_v: bool | None = None,
    use_flash_attn: bool = False,
) -> torch.Tensor:
    """Same contract as `diff_attention_reference`; `split_v` defaults to True on CUDA."""
    if attention_mask is not None:
        raise ValueError("the sdpa backend is causal-only; use the reference backend for custom masks")
    call = _flash if use_flash_attn else _sdpa
    if split_v is None:
        split_v = use_flash_attn or q1.is_cuda
    if split_v:
        d = v.shape[-1] // 2
        halves = (v[..., :d], v[..., d:])  # [b, g, sk, d] each
        o1 = torch.cat([call(q1, k1, vh, scale, dropout_p) for vh in halves], dim=-1)  # [b, h, sq, 2d]
        o2 = torch.cat([call(q2, k2, vh, scale, dropout_p) for vh in halves], dim=-1)
    else:
        o1 = call(q1, k1, v, scale, dropout_p)  # [b, h, sq, 2d]
        o2 = call(q2, k2, v, scale, dropout_p)
    return _Combine.apply(o1, o2, lam)
