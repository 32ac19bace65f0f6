"""Plain-math differential attention: the readable definition, used by tests and as a fallback."""

from __future__ import annotations

from collections.abc import Callable

import torch


def causal_keep_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """[sq, sk] bool, True where query i (at absolute position sk - sq + i) may see key j."""
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)  # [sq, 1]
    k_pos = torch.arange(sk, device=device).unsqueeze(0)  # [1, sk]
    return k_pos <= q_pos


def softmax_map(
    q: torch.Tensor,
    k: torch.Tensor,
    keep: torch.Tensor,
    scale: float,
    logit_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, softmax map) [b, h, sq, sk] in fp32 or wider: q [b, h, sq, d] against k [b, h, sk, d],
    entries outside `keep` [sq, sk] masked; `logit_fn(logits, keep)` transforms the logits first (the
    evaluation's quantization)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    logits = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    if logit_fn is not None:
        logits = logit_fn(logits, keep)
    return logits, torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)


def diff_attention_reference(
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
    """`(A1 - lam * A2) V` by explicit softmaxes (fp32 or wider), causal, optional extra mask.

    `attention_mask` follows megatron-core's convention: True marks a position that is masked OUT;
    it broadcasts to [b, h, sq, sk] and is applied on top of the causal mask.
    """
    b, h, sq, d = q1.shape
    n, g, sk = q2.shape[1], k1.shape[1], k1.shape[2]
    # GQA: signal head j reads KV head j // (h/g), noise head m reads m // (n/g): [b, g, sk, .] -> [b, h|n, .]
    k1, v1 = (t.repeat_interleave(h // g, dim=1) for t in (k1, v))
    k2 = k2.repeat_interleave(n // g, dim=1)
    keep = causal_keep_mask(sq, sk, q1.device)  # [sq, sk]
    if attention_mask is not None:
        keep = keep & ~attention_mask.bool()
    (_, a1), (_, a2) = softmax_map(q1, k1, keep, scale), softmax_map(q2, k2, keep, scale)  # [b, h|n, sq, sk]
    # each noise map against its h/n signal heads, by broadcasting: [b, n, h/n, sq, sk] - [b, n, 1, sq, sk]
    diff_map = a1.view(b, n, h // n, sq, sk) - lam.to(a1.dtype) * a2.view(b, n, 1, sq, sk)
    diff_map = diff_map.view(b, h, sq, sk)
    if dropout_p > 0.0:
        diff_map = torch.nn.functional.dropout(diff_map, p=dropout_p)
    return torch.matmul(diff_map, v1.to(diff_map.dtype)).to(q1.dtype)  # [b, h, sq, 2d]


def lambda_grad_scale(
    q2: torch.Tensor, k2: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, scale: float
) -> float:
    """sum(|dO| * |A2 V|) in float64: the scale an error of dlambda = -sum(dO * A2 V) is measured against.

    dlambda is one sum of millions of products of either sign: the sum cancels to a small fraction of
    its terms, so an error relative to dlambda itself amplifies the terms' own rounding by that
    cancellation and varies from draw to draw (on an H100, torch's SDPA path measured 1.8e-4 to 1.5e-3
    relative to dlambda between draws; benchmarks/results/lambda-grad-precision-*.jsonl).
    A dot product's rounding error is bounded by a multiple of sum(|x| |y|): that is the scale here.
    """
    q2, k2, v = (t.detach().double() for t in (q2, k2, v))
    zero = torch.zeros((), dtype=torch.float64, device=q2.device)
    a2v = diff_attention_reference(q2, q2, k2, k2, v, zero, scale=scale)  # lambda 0: A1 V, here A1 = A2
    return (dout.detach().double().abs() * a2v.abs()).sum().item()


def diff_errors(xs: list[torch.Tensor], refs: list[torch.Tensor], lam_scale: float) -> list[float]:
    """Errors of a DIFF attention call's output and gradients (out, dq1, dq2, dk1, dk2, dv, dlambda) against
    their float64 references: max|x - ref| / max|ref| per tensor, and dlambda's |x - ref| over `lam_scale`
    (`lambda_grad_scale`: its terms' scale, not the cancelled sum's). One rule for the GPU kernel tests
    and the campaign's check of each backend and tile candidate."""
    errs = [
        ((x.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
        for x, r in zip(xs[:-1], refs[:-1], strict=True)
    ]
    return errs + [(xs[-1].double() - refs[-1]).abs().max().item() / lam_scale]
