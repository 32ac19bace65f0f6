"""megatron-core's core-attention contract, written once for diffmeg's core attentions.

megatron-core's `SelfAttention` builds its `core_attention` submodule with `DotProductAttention`'s
constructor keywords and calls it with per-partition q/k/v `[s, b, heads, d]`. Every core here
(differential, SDPA, the Ulysses wrapper) takes those keywords and refuses the same unsupported inputs,
so the contract lives in this base class and each subclass implements `attend` only.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from diffmeg.errors import DiffmegError


def context_parallel_group(pg_collection) -> torch.distributed.ProcessGroup:
    """The CP group of `pg_collection`, else megatron-core's global one (older call sites pass none)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    return group if group is not None else parallel_state.get_context_parallel_group()


class CoreAttention(MegatronModule):
    """Base of diffmeg's core attentions: causal (or no-mask) attention without packed sequences or bias.

    Subclasses implement `attend(query, key, value, attention_mask, attn_mask_type)`; `name` is what the
    one-line errors call them.
    """

    name = "this core attention"

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise DiffmegError(f"{self.name} is causal-only, got mask type {attn_mask_type}")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        self.cp_comm_type = cp_comm_type

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise DiffmegError(f"{self.name} does not support packed sequences or attention bias")
        return self.attend(query, key, value, attention_mask, attn_mask_type or self.attn_mask_type)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType,
    ) -> torch.Tensor:
        """q/k/v `[s, b, heads, d]` of this partition; `attention_mask` megatron-core's (True = masked out)
        or None; `attn_mask_type` the call's, else the layer's. Subclasses override it with the same
        (unannotated) signature."""
        raise NotImplementedError

    def dropout_rng(self) -> contextlib.AbstractContextManager:
        """megatron-core's tensor-parallel RNG around attention dropout (each TP rank drops its own heads'
        probabilities); a no-op without dropout or under sequence parallelism, as in megatron-core."""
        if self.training and self.dropout_p > 0.0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()
