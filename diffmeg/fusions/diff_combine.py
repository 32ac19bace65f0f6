"""DIFF's combination step, the op between attention and the output projection, in one place.

- V1 (`diff_combine`): `o1 - lam * o2` of the two maps' outputs (each [b, h, sq, 2d]) and the layer's
  scalar lambda, in fp32 or wider as the reference computes it. The entry point
  runs `DiffCombine`, which saves o2 as it came; `diff_combine_eager` is its eager twin (plain autograd of
  the fp32 expression, which would save an fp32 copy of o2: twice the bytes under bf16).
- V2 (`combine_head_pairs`): `attn[2i] - lam_i * attn[2i+1]` with a per-token, per-head lambda.

- V1's epilogue (`diff_epilogue`): what follows the backend's combination, head RMSNorm,
  `* (1 - lambda_init)` and the permute to seq-first, as plain ops (`--compile-layers` compiles it with the
  rest of the layer). The combination itself stays inside the attention backends (`diffmeg.kernels`:
  SDPA's runs `diff_combine`).
"""

from __future__ import annotations

import torch

from diffmeg.fusions.rms_norm import NormFn, rms_norm


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class DiffCombine(torch.autograd.Function):
    """`o1 - lam * o2` computed in fp32 (or wider).

    In the activation dtype lambda would be rounded to bf16 and its gradient -sum(dO * o2) summed in bf16.
    Autograd of the fp32 expression would save o2 in fp32 (twice the bytes); this keeps o2 as it came.
    """

    @staticmethod
    def forward(ctx, o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        wide = _wide(o1.dtype)
        ctx.save_for_backward(o2, lam)
        return (o1.to(wide) - lam.to(wide) * o2.to(wide)).to(o1.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        o2, lam = ctx.saved_tensors
        wide = _wide(dout.dtype)
        do2 = (-lam.to(wide) * dout.to(wide)).to(o2.dtype) if ctx.needs_input_grad[1] else None
        dlam = None
        if ctx.needs_input_grad[2]:
            dlam = -(dout.to(wide) * o2.to(wide)).sum().to(lam).reshape(lam.shape)
        return (dout if ctx.needs_input_grad[0] else None), do2, dlam


def diff_combine(o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """DIFF V1's `o1 - lam * o2` ([b, h, sq, 2d] each, lam 0-dim) in o1's dtype, combined in fp32."""
    return DiffCombine.apply(o1, o2, lam)


def diff_combine_eager(o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """`diff_combine`'s eager twin: the same values and gradients through plain autograd."""
    wide = _wide(o1.dtype)
    return (o1.to(wide) - lam.to(wide) * o2.to(wide)).to(o1.dtype)


def combine_head_pairs(attn: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """DIFF V2's `attn[2i] - lam_i * attn[2i+1]` in fp32 (or wider): [s, b, 2n * d], [s, b, n] ->
    [s, b, n * d] in attn's dtype."""
    s, b, n = lam.shape
    dtype = _wide(attn.dtype)
    pairs = attn.view(s, b, n, 2, -1).to(dtype)  # [s, b, 2n * d] -> [s, b, n, 2, d]; pair i = heads 2i, 2i+1
    out = pairs[..., 0, :] - lam.to(dtype).unsqueeze(-1) * pairs[..., 1, :]  # [s, b, n, d]
    return out.to(attn.dtype).reshape(s, b, -1)  # [s, b, n, d] -> [s, b, n * d]


def diff_epilogue(
    out: torch.Tensor, weight: torch.Tensor, eps: float, scale: float, norm: NormFn = rms_norm
) -> torch.Tensor:
    """DIFF V1's epilogue: `norm(out) * scale` ([b, h, sq, 2d], scale = 1 - lambda_init) laid out
    seq-first, [sq, b, h, 2d] contiguous, so the heads flatten into the output projection's input."""
    return (norm(out, weight, eps) * scale).permute(2, 0, 1, 3).contiguous()
