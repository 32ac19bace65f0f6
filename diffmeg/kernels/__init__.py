"""Differential attention backends behind one signature (see `reference.diff_attention_reference`).

Every backend takes batch-first tensors:
  q1:     [b, h, sq, d]   the signal query of each differential head
  q2:     [b, n, sq, d]   the noise queries (n divides h: signal head j pairs with noise head j // (h / n);
                          n = h for the 1:1 DIFF, n < h for grouped differential attention)
  k1, k2: [b, g, sk, d]   the two key maps of each differential KV head (g divides n; GQA)
  v:      [b, g, sk, 2d]  the values of each differential KV head
  lam:    0-dim tensor     lambda (its gradient flows back through the backend)
and returns `softmax(q1_j k1^T s) v - lam * softmax(q2_{j // (h/n)} k2^T s) v` for each signal head j as
[b, h, sq, 2d], causal with the queries aligned to the *end* of the keys (so a KV-cache decode step with
sq < sk is causal too); the noise map is computed once per noise head, not once per signal head.

Which backend runs (and what `auto` is) is `diffmeg.registry`'s `diff_attention` slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DiffAttentionFn = Callable[..., torch.Tensor]


def split_query_heads(query: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's query (sub-)heads of a DIFF layer, seq-first [s, b, h + n, d] laid out group by
    group `[signal x ratio, noise]` (ratio = h / n; 1: the 1:1 pairs 2i, 2i+1), as the signal heads
    [s, b, h, d] and the noise heads [s, b, n, d] (views where the layout allows: always for ratio 1)."""
    s, b, heads, d = query.shape
    n = heads // (ratio + 1)
    groups = query.view(s, b, n, ratio + 1, d)  # [s, b, h + n, d] -> [s, b, n, r + 1, d]
    return groups[:, :, :, :ratio].reshape(s, b, n * ratio, d), groups[:, :, :, ratio]
