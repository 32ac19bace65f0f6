"""Rotary position embedding of q and k: megatron-core's eager RoPE and the same function compiled.

megatron-core's `SelfAttention` applies RoPE through `rope_utils.apply_rotary_pos_emb`, whose only fused
path (`apply_rope_fusion`) is Transformer Engine's; without TE it runs `_apply_rotary_pos_emb_bshd` as
eager ops (cos, sin, two casts, a chunk, a negation, a concatenation, two products and a sum, each way).
- `rope_eager`: that function, the reference;
- `rope_compiled`: the same function through `torch.compile`, one generated kernel forward and backward.

The hook (`FusedRopeMixin`): megatron-core's attention gives no way to swap its RoPE function, so the mixin
takes the rotary embedding away from megatron-core's `forward` and applies the chosen function right after
`get_query_key_value_tensors`, where megatron-core's would run next (q/k norms, if any, come first in both).
It does so only for training-shaped calls: no inference context, no packed (thd) sequences, no flash
decode; every other call runs megatron-core's own path unchanged. The registry's `rope` slot
(`--rope-impl`) chooses; `megatron` (auto) leaves megatron-core's attention classes as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig

RopeFn = Callable[[torch.Tensor, torch.Tensor, TransformerConfig], torch.Tensor]
"""(t [s, b, heads, d], freqs [s, 1, 1, d] fp32, config) -> t rotated, in t's dtype."""


def rope_eager(t: torch.Tensor, freqs: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """megatron-core's unfused RoPE (`_apply_rotary_pos_emb_bshd`), as its attention runs it today."""
    return _apply_rotary_pos_emb_bshd(
        t,
        freqs,
        rotary_interleaved=config.rotary_interleaved,
        multi_latent_attention=config.multi_latent_attention,
    )


@functools.cache
def _compiled_bshd() -> Callable[..., torch.Tensor]:
    # Built on first use: importing this module compiles nothing.
    return torch.compile(_apply_rotary_pos_emb_bshd, dynamic=False)


def rope_compiled(t: torch.Tensor, freqs: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """`rope_eager` as one `torch.compile`d region (forward and backward)."""
    return _compiled_bshd()(
        t,
        freqs,
        rotary_interleaved=config.rotary_interleaved,
        multi_latent_attention=config.multi_latent_attention,
    )


class FusedRopeMixin:
    """Put before a megatron-core `SelfAttention` (sub)class: q and k are rotated by `rope_fn` (a spec
    parameter) instead of megatron-core's RoPE, for training-shaped calls (see the module docstring)."""

    def __init__(self, *args, rope_fn: RopeFn, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rope_fn = rope_fn
        self._rope_freqs: tuple[torch.Tensor | None, torch.Tensor | None] | None = None

    def forward(self, *args, **kwargs):
        freqs = kwargs.get("rotary_pos_emb")
        packed = kwargs.get("packed_seq_params")
        if (
            freqs is None
            or kwargs.get("inference_context") is not None
            or (packed is not None and packed.qkv_format == "thd")
            or self.config.flash_decode
        ):
            return super().forward(*args, **kwargs)
        self._rope_freqs = freqs if isinstance(freqs, tuple) else (freqs, freqs)
        try:
            return super().forward(*args, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._rope_freqs = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        qkv = super().get_query_key_value_tensors(*args, **kwargs)
        if self._rope_freqs is None or not kwargs.get("split_qkv", True):
            return qkv
        q_freqs, k_freqs = self._rope_freqs
        query, key = qkv[0], qkv[1]
        if q_freqs is not None:
            query = self.rope_fn(query, q_freqs, self.config)
        if k_freqs is not None:
            key = self.rope_fn(key, k_freqs, self.config)
        return (query, key, *qkv[2:])


class FusedRopeSelfAttention(FusedRopeMixin, SelfAttention):
    """megatron-core's `SelfAttention` with the chosen RoPE function (the baseline's and DIFF V1's)."""
