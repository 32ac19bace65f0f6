"""DIFF's combination step, the op between attention and the output projection, in one place.

- V1 (`diff_combine`): `o1 - lam * o2` of the two maps' outputs (o1 [b, h, sq, 2d] of the signal heads,
  o2 [b, n, sq, 2d] of the noise heads, n dividing h: signal head j subtracts noise head j // (h / n); n = h
  for the 1:1 DIFF) and the layer's scalar lambda, in fp32 or wider as the reference computes it. The entry
  point runs `DiffCombine`, which saves o2 as it came; `diff_combine_eager` is its eager twin (plain
  autograd of the fp32 expression, which would save an fp32 copy of o2: twice the bytes under bf16).
- V2 (`combine_head_groups`): per group of r signal heads and their noise head, `attn[signal j] - lam_j *
  attn[noise]` with a per-token, per-head lambda (r = 1: `attn[2i] - lam_i * attn[2i+1]`).

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


def _grouped(o1: torch.Tensor, o2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o1 [b, h, sq, e] and o2 [b, n, sq, e] as [b, n, h/n, sq, e] and [b, n, 1, sq, e]: signal head j
    against noise head j // (h / n), by broadcasting."""
    b, h, sq, e = o1.shape
    n = o2.shape[1]
    if h % n:
        raise ValueError(f"{n} noise heads do not divide the {h} signal heads")
    return o1.view(b, n, h // n, sq, e), o2.view(b, n, 1, sq, e)


class DiffCombine(torch.autograd.Function):
    """`o1 - lam * o2` computed in fp32 (or wider), each noise head's o2 shared by its group's signal heads.

    In the activation dtype lambda would be rounded to bf16 and its gradient -sum(dO * o2) summed in bf16.
    Autograd of the fp32 expression would save o2 in fp32 (twice the bytes); this keeps o2 as it came.
    """

    @staticmethod
    def forward(ctx, o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        wide = _wide(o1.dtype)
        ctx.save_for_backward(o2, lam)
        g1, g2 = _grouped(o1, o2)  # [b, n, r, sq, 2d], [b, n, 1, sq, 2d]
        out = g1.to(wide) - lam.to(wide) * g2.to(wide)
        return out.to(o1.dtype).reshape(o1.shape)  # [b, n, r, sq, 2d] -> [b, h, sq, 2d]

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        o2, lam = ctx.saved_tensors
        wide = _wide(dout.dtype)
        dg, g2 = _grouped(dout, o2)  # [b, n, r, sq, 2d], [b, n, 1, sq, 2d]
        do2 = None
        if ctx.needs_input_grad[1]:  # a noise head's gradient: the sum over its r signal heads
            do2 = (-lam.to(wide) * dg.to(wide)).sum(2).to(o2.dtype)
        dlam = None
        if ctx.needs_input_grad[2]:
            dlam = -(dg.to(wide) * g2.to(wide)).sum().to(lam).reshape(lam.shape)
        return (dout if ctx.needs_input_grad[0] else None), do2, dlam


def diff_combine(o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """DIFF V1's `o1 - lam * o2` (o1 [b, h, sq, 2d], o2 [b, n, sq, 2d], lam 0-dim) in o1's dtype, combined
    in fp32."""
    return DiffCombine.apply(o1, o2, lam)


def diff_combine_eager(o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """`diff_combine`'s eager twin: the same values and gradients through plain autograd."""
    wide = _wide(o1.dtype)
    g1, g2 = _grouped(o1, o2)
    return (g1.to(wide) - lam.to(wide) * g2.to(wide)).to(o1.dtype).reshape(o1.shape)


def combine_head_groups(attn: torch.Tensor, lam: torch.Tensor, ratio: int = 1) -> torch.Tensor:
    """DIFF V2's combination in fp32 (or wider): attn [s, b, (h + n) * d] holds n groups of `ratio` = h / n
    signal heads and their noise head, lam [s, b, h] -> [s, b, h * d] in attn's dtype; signal head j = g r + i
    outputs `attn[group g, head i] - lam_j * attn[group g, noise]`."""
    s, b, h = lam.shape
    n = h // ratio
    dtype = _wide(attn.dtype)
    groups = attn.view(s, b, n, ratio + 1, -1).to(dtype)  # [s, b, (h + n) d] -> [s, b, n, r + 1, d]
    signal, noise = groups[..., :ratio, :], groups[..., ratio:, :]  # [s, b, n, r, d], [s, b, n, 1, d]
    out = signal - lam.to(dtype).view(s, b, n, ratio, 1) * noise  # [s, b, n, r, d]
    return out.to(attn.dtype).reshape(s, b, -1)  # [s, b, n, r, d] -> [s, b, h * d]


def diff_epilogue(
    out: torch.Tensor, weight: torch.Tensor, eps: float, scale: float, norm: NormFn = rms_norm
) -> torch.Tensor:
    """DIFF V1's epilogue: `norm(out) * scale` ([b, h, sq, 2d], scale = 1 - lambda_init) laid out
    seq-first, [sq, b, h, 2d] contiguous, so the heads flatten into the output projection's input."""
    return (norm(out, weight, eps) * scale).permute(2, 0, 1, 3).contiguous()
