"""Ulysses-style context parallelism for differential attention over megatron-core's CP group.

Outside attention each CP rank holds a slice of the sequence; inside, an all-to-all trades it for a
slice of the heads over the whole sequence, so any attention backend (reference, each SDPA path) sees
complete causal sequences. The token layout is megatron-core's load-balanced one (which its RoPE
slicing assumes): the sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r.
Heads are split in whole differential heads (and whole K1/K2 pairs), so a head's two maps and its V
never straddle ranks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import all_to_all
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from diffmeg.core_attention import CoreAttention, context_parallel_group


def cp_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the 2*cp sequence chunks that CP rank `cp_rank` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def slice_sequence_for_cp(t: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This CP rank's tokens of a full-sequence tensor (batches: tokens, labels, masks, positions)."""
    if cp_size == 1:
        return t
    if t.shape[seq_dim] % (2 * cp_size):
        raise ValueError(f"sequence length {t.shape[seq_dim]} is not divisible by 2 x CP = {2 * cp_size}")
    chunks = t.chunk(2 * cp_size, dim=seq_dim)
    a, b = cp_chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[a], chunks[b]], dim=seq_dim)


def natural_order(seq_len: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """Index that turns the rank-concatenated sequence [r0: c0 c_{2cp-1} | r1: c1 c_{2cp-2} | ...]
    into natural order: natural = gathered[index]."""
    chunk = seq_len // (2 * cp_size)
    position_of_chunk = {}
    for rank in range(cp_size):
        for slot, c in enumerate(cp_chunk_ids(rank, cp_size)):
            position_of_chunk[c] = 2 * rank + slot
    order = [position_of_chunk[c] * chunk + i for c in range(2 * cp_size) for i in range(chunk)]
    return torch.tensor(order, dtype=torch.long, device=device)


def sequence_to_head_shards(x: torch.Tensor, group=None) -> torch.Tensor:
    """[s/cp, b, n, e] (this rank's tokens, all n heads) -> [s, b, n/cp, e] (all tokens, its heads)."""
    group = group or parallel_state.get_context_parallel_group()
    cp = group.size()
    s_local, b, n, e = x.shape
    # [s/cp, b, n, e] -> [s/cp, b, cp, n/cp, e] -> [cp, s/cp, b, n/cp, e]: block j goes to rank j
    x = x.view(s_local, b, cp, n // cp, e).permute(2, 0, 1, 3, 4).contiguous()
    x = all_to_all(group, x.view(cp * s_local, b * (n // cp) * e)).view(cp * s_local, b, n // cp, e)
    # received block j = rank j's tokens: [cp * s/cp, b, n/cp, e] in rank-concatenated order
    return x.index_select(0, natural_order(cp * s_local, cp, x.device))


def head_to_sequence_shards(x: torch.Tensor, group=None) -> torch.Tensor:
    """[s, b, n/cp, e] (all tokens, this rank's heads) -> [s/cp, b, n, e]; the inverse of the above."""
    group = group or parallel_state.get_context_parallel_group()
    cp = group.size()
    s, b, n_local, e = x.shape
    inverse = torch.argsort(natural_order(s, cp, x.device))
    x = x.index_select(0, inverse).contiguous()  # rank-concatenated order; block j = rank j's tokens
    x = all_to_all(group, x.view(s, b * n_local * e)).view(cp, s // cp, b, n_local, e)
    # received block j = head group j of our tokens: [cp, s/cp, b, n/cp, e] -> [s/cp, b, n, e]
    return x.permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * n_local, e)


@dataclass
class UlyssesAttentionSubmodules:
    """The core attention that runs on whole sequences inside the all-to-all."""

    attention: ModuleSpec | type = None


class UlyssesAttention(CoreAttention):
    """Any megatron-core core attention under context parallelism, through the all-to-all above.

    Built where megatron-core builds its core attention (same constructor keywords); the wrapped core is
    built for whole sequences and this rank's share of the heads (`num_attention_heads / cp`,
    `num_query_groups / cp`, no CP of its own). Contiguous head blocks keep GQA's query-to-KV mapping.
    Used by DIFF V2, whose core is megatron-core's own attention (V1's core does the same exchange itself).
    """

    name = "Ulysses context parallelism"

    def __init__(
        self,
        config,
        *args,
        submodules: UlyssesAttentionSubmodules | None = None,
        pg_collection=None,
        **kwargs,
    ) -> None:
        """megatron-core's core-attention keywords (`CoreAttention`), plus the core to wrap."""
        if submodules is None or submodules.attention is None:
            raise ValueError("UlyssesAttention needs the core attention to wrap (submodules.attention)")
        super().__init__(config, *args, **kwargs)
        self.cp_group = context_parallel_group(pg_collection)
        cp = self.cp_group.size()
        inner = copy.copy(config)
        inner.context_parallel_size = 1
        inner.cp_comm_type = None
        inner.num_attention_heads = config.num_attention_heads // cp
        inner.num_query_groups = config.num_query_groups // cp
        self.attention = build_module(
            submodules.attention,
            config=inner,
            layer_number=self.layer_number,
            attn_mask_type=self.attn_mask_type,
            attention_type=self.attention_type,
            attention_dropout=self.dropout_p,
            softmax_scale=self.softmax_scale,
            pg_collection=pg_collection,
        )

    def attend(self, query, key, value, attention_mask, attn_mask_type) -> torch.Tensor:  # CoreAttention's
        # [s/cp, b, n, d] -> [s, b, n/cp, d] for q, k and v (whole sequences, this rank's heads)
        query, key, value = (sequence_to_head_shards(t, self.cp_group) for t in (query, key, value))
        out = self.attention(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
        # out: [s, b, n/cp * dv]
        s, b, n_local = query.shape[0], query.shape[1], query.shape[2]
        out = out.reshape(s, b, n_local, -1)  # [s, b, n/cp * dv] -> [s, b, n/cp, dv]
        out = head_to_sequence_shards(out.contiguous(), self.cp_group)  # [s/cp, b, n, dv]
        return out.reshape(out.shape[0], b, -1)  # [s/cp, b, n, dv] -> [s/cp, b, n * dv]
