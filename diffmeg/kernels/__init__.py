"""Differential attention backends behind one signature (see `reference.diff_attention_reference`).

Every backend takes batch-first tensors:
  q1, q2: [b, h, sq, d]   the two query maps of each differential head
  k1, k2: [b, g, sk, d]   the two key maps of each differential KV head (g divides h; GQA)
  v:      [b, g, sk, 2d]  the values of each differential KV head
  lam:    0-dim tensor     lambda (its gradient flows back through the backend)
and returns `(softmax(q1 k1^T s) - lam * softmax(q2 k2^T s)) v` as [b, h, sq, 2d], causal with the
queries aligned to the *end* of the keys (so a KV-cache decode step with sq < sk is causal too).

Which backend runs (and what `auto` is) is `diffmeg.registry`'s `diff_attention` slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DiffAttentionFn = Callable[..., torch.Tensor]
