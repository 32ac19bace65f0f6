"""A plain-torch stand-in for megatron-core's TEDotProductAttention under context parallelism (tests only).

Transformer Engine does not install on CPU, so the TE context-parallel path of the differential core
(`diffmeg.parallel.te_attention.DiffMapsWithCP`) is tested with this module in its place: the same
constructor keywords and call signature, CP by all-gathering K/V. It goes in through the layer spec's
`cp_attention` submodule, or, for a launched training job, through `install()` which makes it the
default CP attention of the process.
"""

from __future__ import annotations

import math

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType

from diffmeg.core_attention import CoreAttention, context_parallel_group
from diffmeg.errors import DiffmegError
from diffmeg.parallel.ulysses import cp_chunk_ids, natural_order


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group` (rank-concatenated); backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=group)  # sum of every rank's dK/dV, then this rank's slice
        return grad.chunk(group.size(), dim=0)[group.rank()].contiguous(), None


class AllGatherCPAttention(CoreAttention):
    """Plain-torch stand-in for megatron-core's `TEDotProductAttention` under context parallelism.

    Same constructor keywords and `forward(query, key, value, attention_mask, attn_mask_type)`; sbhd
    tensors of this rank's load-balanced tokens in, `[s/cp, b, heads * v_channels]` out. K and V are
    all-gathered over the CP group (their gradients reduce-scattered back), put in natural order, and
    each local query attends causally at its global position. It materialises [s/cp, s] scores: for
    tests and CPU debugging, not for speed. It also checks the head counts and channels TE would use.
    """

    name = "AllGatherCPAttention"

    def __init__(
        self,
        config,
        *args,
        k_channels: int | None = None,
        v_channels: int | None = None,
        num_splits: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        **kwargs,
    ) -> None:
        super().__init__(config, *args, **kwargs)
        if self.dropout_p:
            raise DiffmegError("AllGatherCPAttention has no attention dropout")
        tp = config.tensor_model_parallel_size
        self.heads = config.num_attention_heads // tp
        self.kv_heads = config.num_query_groups // tp
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.softmax_scale = kwargs.get("softmax_scale") or 1.0 / math.sqrt(self.k_channels)
        self.cp_group = context_parallel_group(pg_collection)

    def attend(self, query, key, value, attention_mask, mask_type) -> torch.Tensor:  # CoreAttention's
        if attention_mask is not None:
            raise DiffmegError("AllGatherCPAttention supports causal / no-mask attention only")
        s_local, b, n, dk = query.shape
        expected = [(n, dk), (key.shape[2], key.shape[3]), (value.shape[2], value.shape[3])]
        wanted = [
            (self.heads, self.k_channels),
            (self.kv_heads, self.k_channels),
            (self.kv_heads, self.v_channels),
        ]
        if expected != wanted:
            raise DiffmegError(f"q/k/v (heads, channels) {expected} do not match the module's {wanted}")
        group = self.cp_group
        cp, rank = group.size(), group.rank()
        if cp > 1:
            k_all = _GatherSequence.apply(key, group)  # [s, b, g, dk], rank-concatenated chunks
            v_all = _GatherSequence.apply(value, group)
            order = natural_order(k_all.shape[0], cp, key.device)
            k_all, v_all = k_all.index_select(0, order), v_all.index_select(0, order)
            chunk = k_all.shape[0] // (2 * cp)
            q_pos = torch.cat(  # global positions of this rank's chunks r and 2cp-1-r
                [
                    torch.arange(c * chunk, (c + 1) * chunk, device=query.device)
                    for c in cp_chunk_ids(rank, cp)
                ]
            )
        else:
            k_all, v_all = key, value
            q_pos = torch.arange(k_all.shape[0] - s_local, k_all.shape[0], device=query.device)
        dtype = torch.promote_types(query.dtype, torch.float32)
        rep = n // k_all.shape[2]
        q = query.permute(1, 2, 0, 3).to(dtype)  # [b, n, s/cp, dk]
        k = k_all.permute(1, 2, 0, 3).to(dtype).repeat_interleave(rep, dim=1)  # [b, n, s, dk]
        v = v_all.permute(1, 2, 0, 3).to(dtype).repeat_interleave(rep, dim=1)  # [b, n, s, dv]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale  # [b, n, s/cp, s]
        if mask_type == AttnMaskType.causal:
            keep = torch.arange(k.shape[2], device=query.device)[None, :] <= q_pos[:, None]
            scores = scores.masked_fill(~keep, float("-inf"))
        elif mask_type != AttnMaskType.no_mask:
            raise DiffmegError(f"AllGatherCPAttention does not support mask type {mask_type}")
        out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)  # [b, n, s/cp, dv]
        return out.permute(2, 0, 1, 3).reshape(s_local, b, n * self.v_channels)


def install() -> None:
    """Make the stand-in this process's default CP attention (for a training job launched by a test)."""
    import diffmeg.parallel.te_attention as te_attention

    te_attention.default_cp_attention = lambda: AllGatherCPAttention
