"""megatron-core's own context parallelism (Transformer Engine) for the differential core.

`--cp-comm-type` picks how a differential layer shards the sequence over megatron-core's CP group:

- `ulysses` (the DIFF default, no TE needed): `diffmeg.context_parallel`'s all-to-all trades sequence
  shards for whole heads around any attention backend.
- `p2p` (ring), `all_gather`, `a2a`: megatron-core's `TEDotProductAttention` does the CP exchange inside
  the attention kernel, as it does for the Transformer baseline. DIFF's output is linear in the two
  attention results, `softmax(Q1 K1^T s) V - lambda softmax(Q2 K2^T s) V`, so two CP-aware calls on this
  rank's load-balanced tokens (chunks r and 2cp-1-r, `slice_sequence_for_cp`) followed by the lambda
  combination, the head RMSNorm and `(1 - lambda_init)` (in `DiffCoreAttention`) give the same result.
  GQA: each call sees Q1 (or Q2) as h heads and K1 (or K2) as the g KV heads of the pairs, with V of
  width 2d. TE's CP accepts a V head size different from Q/K's only with `p2p` (TE tests skip "MLA CP"
  otherwise), so `all_gather` and `a2a` split V into its two d-wide halves: four calls.

Status: the TE path was written against megatron-core 0.16.1's `TEDotProductAttention` signature and
tested only through `AllGatherCPAttention`, a plain-torch stand-in with the same constructor, call
signature and CP semantics, injected through `use_cp_attention_factory` (tests/distributed/test_te_cp.py).
It has NOT run with Transformer Engine on a GPU; `pytest -m gpu tests/distributed/test_te_cp.py` checks it
against the Ulysses path where both exist. The `ulysses` default stays until that test has passed.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
from collections.abc import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from diffmeg.context_parallel import _natural_order, cp_chunk_ids
from diffmeg.errors import DiffmegError

TE_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""megatron-core's `cp_comm_type` values (Megatron-LM's `--cp-comm-type`), all done inside TE's attention."""

CP_COMM_TYPES = ("ulysses", *TE_CP_COMM_TYPES)
"""`--cp-comm-type` choices: diffmeg's all-to-all plus megatron-core's."""

CPAttentionFactory = Callable[..., torch.nn.Module]
_factory: CPAttentionFactory | None = None


def te_attention_available() -> bool:
    """megatron-core's TEDotProductAttention can be built here (transformer_engine imports, CUDA exists)."""
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def cp_attention_available() -> bool:
    """A CP-aware attention module can be built: TE on a GPU, or a stand-in installed by a test."""
    return _factory is not None or te_attention_available()


@contextlib.contextmanager
def use_cp_attention_factory(factory: CPAttentionFactory | None) -> Iterator[None]:
    """Build CP attention with `factory` (same keyword arguments as TEDotProductAttention) meanwhile.

    The seam for tests without TE: `AllGatherCPAttention` stands in where TEDotProductAttention would be
    constructed. Used as a plain call (`use_cp_attention_factory(f).__enter__()`) it stays installed.
    """
    global _factory
    previous, _factory = _factory, factory
    try:
        yield
    finally:
        _factory = previous


def _build(**kwargs) -> torch.nn.Module:
    if _factory is not None:
        return _factory(**kwargs)
    if not te_attention_available():
        raise DiffmegError(
            f"--cp-comm-type {kwargs['cp_comm_type']} runs megatron-core's TEDotProductAttention, which "
            f"needs transformer_engine and a CUDA GPU; use --cp-comm-type ulysses"
        )
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention(**kwargs)


class DiffMapsWithCP(MegatronModule):
    """`softmax(Q1 K1^T s) V - lam softmax(Q2 K2^T s) V` for this CP rank's tokens, CP done by the maps.

    In: megatron-core's per-partition sub-heads on this rank's load-balanced tokens, query
    `[s/cp, b, 2h, d]`, key/value `[s/cp, b, 2g, d]`. Out: `[s/cp, b, h, 2d]` (before the head norm).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        softmax_scale: float,
        cp_comm_type: str,
        pg_collection: ProcessGroupCollection | None,
    ) -> None:
        super().__init__(config=config)
        if cp_comm_type not in TE_CP_COMM_TYPES or cp_comm_type == "a2a+p2p":
            raise DiffmegError(
                f"cp_comm_type {cp_comm_type!r} is not a TE context-parallel mode diffmeg supports; "
                f"use p2p, all_gather or a2a"
            )
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        d = config.kv_channels
        self.head_dim = d
        # TE's CP takes a V head size unlike Q/K's only in the ring (p2p) implementation.
        self.split_value = cp_comm_type != "p2p"
        # Each call is an ordinary attention of h query heads over the g KV heads of one map.
        map_config = copy.copy(config)
        map_config.num_attention_heads = config.num_attention_heads // 2
        map_config.num_query_groups = config.num_query_groups // 2
        map_config.attention_dropout = 0.0
        kwargs = dict(
            config=map_config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            attention_dropout=0.0,
            softmax_scale=softmax_scale,
            k_channels=d,
            v_channels=d if self.split_value else 2 * d,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.map1 = _build(**kwargs)
        self.map2 = _build(**kwargs)

    def _attend(
        self, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """One map's `softmax(q k^T s) v`: [s, b, h, d] x [s, b, g, d] x [s, b, g, 2d] -> [s, b, h, 2d]."""
        s, b, h = q.shape[:3]
        d = self.head_dim
        if self.split_value:
            halves = (v[..., :d].contiguous(), v[..., d:].contiguous())  # [s, b, g, d] each
            outs = [attn(q, k, vh, None, attn_mask_type=AttnMaskType.causal) for vh in halves]
            return torch.cat([o.reshape(s, b, h, d) for o in outs], dim=-1)
        return attn(q, k, v, None, attn_mask_type=AttnMaskType.causal).reshape(s, b, h, 2 * d)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lam: torch.Tensor
    ) -> torch.Tensor:
        s, b, d = query.shape[0], query.shape[1], self.head_dim
        sk = key.shape[0]
        h, g = query.shape[2] // 2, key.shape[2] // 2
        # Adjacent sub-heads: [s, b, 2h, d] -> [s, b, h, 2, d]; [..., 0, :] is Q1, [..., 1, :] is Q2.
        q = query.view(s, b, h, 2, d)
        k = key.view(sk, b, g, 2, d)
        v = value.reshape(sk, b, g, 2 * d).contiguous()  # V of KV head j: sub-heads 2j, 2j+1 side by side
        q1, q2 = q[..., 0, :].contiguous(), q[..., 1, :].contiguous()  # [s, b, h, d]
        k1, k2 = k[..., 0, :].contiguous(), k[..., 1, :].contiguous()  # [sk, b, g, d]
        o1 = self._attend(self.map1, q1, k1, v)  # [s, b, h, 2d]
        o2 = self._attend(self.map2, q2, k2, v)
        return o1 - lam.to(o1.dtype) * o2


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


class AllGatherCPAttention(torch.nn.Module):
    """Plain-torch stand-in for megatron-core's `TEDotProductAttention` under context parallelism.

    Same constructor keywords and `forward(query, key, value, attention_mask, attn_mask_type)`; sbhd
    tensors of this rank's load-balanced tokens in, `[s/cp, b, heads * v_channels]` out. K and V are
    all-gathered over the CP group (their gradients reduce-scattered back), put in natural order, and
    each local query attends causally at its global position. It materialises [s/cp, s] scores: for
    tests and CPU debugging, not for speed. It also checks the head counts and channels TE would use.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        num_splits: int | None = None,
        cp_comm_type: str | None = "p2p",
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise DiffmegError("AllGatherCPAttention has no attention dropout")
        tp = config.tensor_model_parallel_size
        self.heads = config.num_attention_heads // tp
        self.kv_heads = config.num_query_groups // tp
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.attn_mask_type = attn_mask_type
        self.cp_comm_type = cp_comm_type
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()

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
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise DiffmegError("AllGatherCPAttention supports causal / no-mask attention only")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
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
            order = _natural_order(k_all.shape[0], cp, key.device)
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
