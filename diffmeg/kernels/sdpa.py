"""Differential attention from fused-attention calls: `A1 V - lam * A2 V`.

torch's SDPA computes softmax(QK^T)V without materialising the map, so DIFF costs two calls that share
V. Kernels that need equal q/k/v head sizes (FlashAttention on GPU) get V split into its two d-wide
halves: four calls, or those four stacked into one batched call. Which path a length takes is
`diffmeg.kernels.sdpa_paths` (measured crossovers).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from diffmeg.fusions.diff_combine import diff_combine
from diffmeg.kernels.reference import causal_keep_mask
from diffmeg.kernels.sdpa_paths import check_path, path_for_length


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float) -> torch.Tensor:
    sq, sk = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    # KV-cache step (sq < sk): queries sit at the end of the keys (SDPA's is_causal aligns them to the start)
    mask = None if sq == sk else causal_keep_mask(sq, sk, q.device)  # [sq, sk], True = attend
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, dropout_p=dropout_p, enable_gqa=gqa
    )


def _split_v_batched(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-V's four (d, d) products as one call: (map 1, half a), (1, b), (2, a), (2, b) on the batch.
    With fewer noise heads than signal heads (grouped differential attention) the maps cannot share a
    batch: one call per map, its two halves on the batch."""
    b, d = q1.shape[0], v.shape[-1] // 2
    va, vb = v[..., :d], v[..., d:]
    if q1.shape[1] != q2.shape[1]:
        halves = torch.cat([va, vb])  # [2b, g, sk, d]
        o1a, o1b = _sdpa(torch.cat([q1, q1]), torch.cat([k1, k1]), halves, scale, dropout_p).split(b)
        o2a, o2b = _sdpa(torch.cat([q2, q2]), torch.cat([k2, k2]), halves, scale, dropout_p).split(b)
        return torch.cat([o1a, o1b], dim=-1), torch.cat([o2a, o2b], dim=-1)  # [b, h|n, sq, 2d]
    q = torch.cat([q1, q1, q2, q2])  # [4b, h, sq, d]
    k = torch.cat([k1, k1, k2, k2])  # [4b, g, sk, d]
    out = _sdpa(q, k, torch.cat([va, vb, va, vb]), scale, dropout_p)  # [4b, h, sq, d]
    o1a, o1b, o2a, o2b = out.split(b)
    return torch.cat([o1a, o1b], dim=-1), torch.cat([o2a, o2b], dim=-1)  # [b, h, sq, 2d] each


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
    path: str | None = None,
) -> torch.Tensor:
    """Same contract as `diff_attention_reference`. `path` (`sdpa_paths.PATHS`) forces one; `split_v`
    True/False means `split_v`/`two_call`; neither: the measured path for this many keys on this device
    (`sdpa_paths.path_for_length`)."""
    if attention_mask is not None:
        raise ValueError("the sdpa backend is causal-only; use the reference backend for custom masks")
    if path is None and split_v is not None:
        path = "split_v" if split_v else "two_call"
    if path is None:
        path = path_for_length(k1.shape[-2], q1.device.type)
    check_path(path)
    if path == "split_v":
        d = v.shape[-1] // 2
        halves = (v[..., :d], v[..., d:])  # [b, g, sk, d] each
        o1 = torch.cat([_sdpa(q1, k1, vh, scale, dropout_p) for vh in halves], dim=-1)  # [b, h, sq, 2d]
        o2 = torch.cat([_sdpa(q2, k2, vh, scale, dropout_p) for vh in halves], dim=-1)
    elif path == "split_v_batched":
        o1, o2 = _split_v_batched(q1, q2, k1, k2, v, scale, dropout_p)
    else:
        o1 = _sdpa(q1, k1, v, scale, dropout_p)  # [b, h, sq, 2d]
        o2 = _sdpa(q2, k2, v, scale, dropout_p)  # [b, n, sq, 2d]: each noise map once
    return diff_combine(o1, o2, lam)


# The registry's rows that force one path (candidates `sdpa` chooses among).
diff_attention_two_call = partial(diff_attention_sdpa, path="two_call")
diff_attention_split_v = partial(diff_attention_sdpa, path="split_v")
diff_attention_split_v_batched = partial(diff_attention_sdpa, path="split_v_batched")
