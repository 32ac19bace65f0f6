"""megatron-core's core-attention contract, written once for diffmeg's core attentions.

megatron-core's `SelfAttention` builds its `core_attention` submodule with `DotProductAttention`'s
constructor keywords and calls it with per-partition q/k/v `[s, b, heads, d]`. Every core here
(differential, SDPA, the Ulysses wrapper) takes those keywords and refuses the same unsupported inputs,
so the contract lives in this base class and each subclass implements `attend` only.

`SDPACoreAttention` is the core the local spec gives everything but DIFF V1 (the Transformer baseline,
DIFF V2): megatron-core's own local `DotProductAttention` materialises the [b, heads, s, s] scores and saves
the probabilities twice, so without Transformer Engine the baseline would pay memory and time DIFF does not.
It lives beside the contract, below the model config, so the implementation registry
(`diffmeg.registry`, which the config reads) can name it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from diffmeg.errors import DiffmegError
from diffmeg.kernels.reference import causal_keep_mask


def context_parallel_group(pg_collection) -> torch.distributed.ProcessGroup:
    """The CP group of `pg_collection`, else megatron-core's global one (older call sites pass none)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    return group if group is not None else parallel_state.get_context_parallel_group()


class CoreAttention(MegatronModule):
    """Base of diffmeg's core attentions: causal (or no-mask) attention without packed sequences or bias.

    Subclasses implement `attend(query, key, value, attention_mask, attn_mask_type)`; `name` is what the
    one-line errors call them. Each runs its SDPA calls under `sdpa_context()`, the context of the config's
    `sdpa_backend` (`DiffTransformerConfig.sdpa_preference`): one place for both cores.
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
        preference = getattr(config, "sdpa_preference", None)  # megatron-core's own config has none
        self.sdpa_context: Callable[[], contextlib.AbstractContextManager] = (
            preference() if preference is not None else contextlib.nullcontext
        )
        """The kernel preference torch's SDPA calls run under (a context per call)."""

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


SDPAFn = Callable[..., torch.Tensor]
"""`torch.nn.functional.scaled_dot_product_attention`'s signature: (q [b, n, sq, d], k, v [b, g, sk, d], *,
attn_mask (bool, True = attend) or None, dropout_p, is_causal, scale, enable_gqa) -> [b, n, sq, d]."""


class SDPACoreAttention(CoreAttention):
    """megatron-core's `core_attention` for ordinary heads through torch's fused SDPA (flash / cuDNN /
    memory-efficient kernels on a GPU, the flash kernel on a CPU): q/k/v `[s, b, heads, d]` per partition
    in, `[sq, b, heads * d]` out, as `DotProductAttention` but without the score matrix.

    Causal with the queries aligned to the end of the keys (a KV-cache step with sq < sk sees every earlier
    key); an explicit `attention_mask` (True = masked out, megatron-core's convention) replaces the causal
    mask, as in megatron-core. GQA maps query head j to KV head j // (heads / groups), megatron-core's
    grouping. Context parallelism needs TE's attention (the TE spec).
    """

    name = "the SDPA core attention"
    override: SDPAFn | None = None
    """When set, called in place of torch's SDPA, same arguments (see `override_attention_backend`)."""

    def __init__(self, config, *args, **kwargs) -> None:
        if config.context_parallel_size > 1:
            raise DiffmegError(
                "the local spec's SDPA core attention has no context parallelism: use the Transformer Engine "
                "spec (--transformer-impl transformer_engine) or --context-parallel-size 1"
            )
        super().__init__(config, *args, **kwargs)

    def attend(self, query, key, value, attention_mask, attn_mask_type) -> torch.Tensor:  # CoreAttention's
        sq, b, heads, _ = query.shape
        sk, groups = key.shape[0], key.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        causal = attn_mask_type == AttnMaskType.causal
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask.bool()  # megatron-core: True = masked out; SDPA: True = attend
        elif causal and sq != sk:
            mask = causal_keep_mask(sq, sk, query.device)  # [sq, sk]: queries at the end of the keys
        dropout_p = self.dropout_p if self.training else 0.0

        def attend() -> torch.Tensor:
            sdpa = self.override or torch.nn.functional.scaled_dot_product_attention
            return sdpa(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None and sq > 1,
                scale=self.softmax_scale, enable_gqa=groups != heads,
            )  # fmt: skip

        with self.dropout_rng(), self.sdpa_context():
            out = attend()
        # [b, n, sq, d] -> [sq, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
