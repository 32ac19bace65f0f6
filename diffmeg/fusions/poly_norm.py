"""PolyNorm, the activation of Motif's MLP (`hidden_act: poly_norm`), with its eager twin.

    PolyNorm(z) = w0 norm(z^3) + w1 norm(z^2) + w2 norm(z) + b,    norm(u) = u / sqrt(mean(u^2) + eps)

over the FFN dimension (Motif's gated MLP: `down(PolyNorm(gate(x)) * up(x))`), weights [3] and bias [1],
computed in fp32 or wider and returned in the input's dtype. Under tensor parallelism each rank holds
F / tp of the FFN dimension, so the means span the whole of it: each rank's per-token sums of squares are
all-reduced over the TP group (in backward the per-token sums the RMS normalisation needs, too).

- `poly_norm` (the entry point) runs `PolyNormFunction`: it saves the input as it came and the three
  per-token reciprocal RMS values, and recomputes the powers in backward. Autograd of the eager
  expression (`poly_norm_eager`, its twin) keeps seven fp32 copies of the [tokens, F / tp] input,
  on a 3B model with F = 8192 the largest activation of the layer.
- `PolyNorm` holds the parameters. Both are replicated on the TP ranks while each rank's gradient covers
  its own share of the FFN dimension: the module that owns them tags them for the TP gradient sum
  (`diffmeg.collectives.SUM_GRAD_OVER_TP_ATTR`).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from diffmeg.collectives import SUM, SUM_GRAD_OVER_TP_ATTR

EPS = 1e-6
"""Motif's epsilon (and the PolyCom paper's)."""

POWERS = (3, 2, 1)
"""The powers of z that weights 0, 1, 2 multiply."""


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _tp(group) -> bool:
    return group is not None and torch.distributed.get_world_size(group) > 1


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if _tp(group):
        torch.distributed.all_reduce(t, op=SUM, group=group)
    return t


class _AllReduceSum(torch.autograd.Function):
    """Sum over `group` in forward and in backward (each rank's share feeds every rank's output): the eager
    twin's TP sums, under plain autograd."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return _all_reduce(t.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


def _terms(powers, rms, weight, bias) -> torch.Tensor:
    """w0 n(z^3) + w1 n(z^2) + w2 n(z) + b from the powers and their reciprocal RMS [..., 3]: one order of
    operations for the Function and its twin."""
    out = sum(weight[i] * u * rms[..., i : i + 1] for i, u in enumerate(powers))
    return out + bias


class PolyNormFunction(torch.autograd.Function):
    """`PolyNorm(z)` over the last dimension of `z` (its whole length `features`, split over `group`)."""

    @staticmethod
    def forward(ctx, z, weight, bias, eps: float, features: int, group):
        wide = _wide(z.dtype)
        x = z.to(wide)
        powers = [x**p for p in POWERS]
        squares = torch.stack([(u * u).sum(-1) for u in powers], dim=-1)  # [..., 3]
        rms = torch.rsqrt(_all_reduce(squares, group) / features + eps)  # [..., 3] reciprocal RMS
        out = _terms(powers, rms, weight.to(wide), bias.to(wide))
        ctx.save_for_backward(z, weight, rms)
        ctx.features, ctx.group = features, group
        return out.to(z.dtype)

    @staticmethod
    def backward(ctx, dout):
        z, weight, rms = ctx.saved_tensors
        wide = _wide(z.dtype)
        x, dy, w = z.to(wide), dout.to(wide), weight.to(wide)
        normed = [x**p * rms[..., i : i + 1] for i, p in enumerate(POWERS)]  # n_p
        # dL/dw_p = sum(dy n_p), dL/db = sum(dy): this rank's share (summed over TP by the step)
        dweight = torch.stack([(dy * n).sum() for n in normed]).to(weight.dtype)
        dbias = dy.sum().reshape(1).to(weight.dtype)
        # RMS normalisation: du = r (dn - n mean(n dn)) with dn = w_p dy, the mean over the whole FFN dim
        dots = torch.stack([(n * dy).sum(-1) * w[i] for i, n in enumerate(normed)], dim=-1)  # [..., 3]
        means = _all_reduce(dots, ctx.group) / ctx.features
        dx = torch.zeros_like(x)
        for i, (p, n) in enumerate(zip(POWERS, normed, strict=True)):
            du = rms[..., i : i + 1] * (w[i] * dy - n * means[..., i : i + 1])
            dx = dx + du * (p * x ** (p - 1) if p > 1 else 1.0)
        return dx.to(z.dtype), dweight, dbias, None, None, None


def poly_norm(
    z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = EPS, features=None, group=None
) -> torch.Tensor:
    """PolyNorm of `z` [..., F / tp] in its dtype (computed in fp32); `features`: the whole FFN dimension
    F (default: z's last dimension), the means taken over it by summing over `group`'s ranks."""
    return PolyNormFunction.apply(z, weight, bias, eps, features or z.shape[-1], group)


def poly_norm_eager(
    z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = EPS, features=None, group=None
) -> torch.Tensor:
    """`poly_norm`'s eager twin: the expression under plain autograd (the TP sums through an all-reduce
    whose backward all-reduces too)."""
    wide = _wide(z.dtype)
    x, features = z.to(wide), features or z.shape[-1]
    powers = [x**p for p in POWERS]
    squares = torch.stack([(u * u).sum(-1) for u in powers], dim=-1)  # [..., 3]
    if _tp(group):
        squares = _AllReduceSum.apply(squares, group)
    rms = torch.rsqrt(squares / features + eps)
    return _terms(powers, rms, weight.to(wide), bias.to(wide)).to(z.dtype)


class PolyNorm(torch.nn.Module):
    """PolyNorm's parameters: `weight` [3] (1/3 each at init, Motif's) and `bias` [1] (0), fp32 whatever
    the model's dtype, replicated on the tensor-parallel ranks (their gradients summed over TP)."""

    def __init__(self, features: int, eps: float = EPS, group=None, device=None) -> None:
        super().__init__()
        self.features, self.eps, self.group = features, eps, group
        self.weight = torch.nn.Parameter(torch.full((3,), 1.0 / 3.0, dtype=torch.float32, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device))
        for p in (self.weight, self.bias):
            setattr(p, SUM_GRAD_OVER_TP_ATTR, True)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return poly_norm(z, self.weight, self.bias, self.eps, self.features, self.group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """megatron-core's MLP asks each submodule for its sharded state: the two tensors, replicated."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)
