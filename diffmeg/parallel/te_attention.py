"""megatron-core's own context parallelism (Transformer Engine attention) for the differential core.

For `--cp-comm-type p2p` (ring), `all_gather` or `a2a`, megatron-core's `TEDotProductAttention` does the
CP exchange inside the attention kernel, as it does for the Transformer baseline. DIFF's output is linear
in the two attention results, `softmax(Q1 K1^T s) V - lambda softmax(Q2 K2^T s) V`, so two CP-aware calls
on this rank's load-balanced tokens (chunks r and 2cp-1-r, `diffmeg.parallel.slice_sequence_for_cp`)
followed by the lambda combination, the head RMSNorm and `(1 - lambda_init)` (in `DiffCoreAttention`)
give the same result. GQA: each call sees Q1 (or Q2) as h heads and K1 (or K2) as the g KV heads of the
pairs, with V of width 2d. TE's CP accepts a V head size different from Q/K's only with `p2p` (TE tests
skip "MLA CP" otherwise), so `all_gather` and `a2a` split V into its two d-wide halves: four calls.

The attention module is a spec submodule (`DiffCoreAttentionSubmodules.cp_attention`), megatron-core's
way to choose an implementation; `default_cp_attention()` gives TE's class where TE can run.
Status: tested on CPU only through a plain-torch stand-in with TE's constructor, call signature and CP
semantics (tests/parallel/cp_stand_in.py); it has NOT run with Transformer Engine on a GPU.
`pytest -m gpu tests/distributed/test_te_cp.py` checks it against the Ulysses path where both exist, which
is why `ulysses` stays the DIFF default.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from diffmeg.errors import DiffmegError
from diffmeg.kernels import split_query_heads
from diffmeg.parallel.validation import TE_CP_COMM_TYPES
from diffmeg.runtime import transformer_engine_available


def default_cp_attention() -> type[torch.nn.Module] | None:
    """megatron-core's TEDotProductAttention where Transformer Engine can run here, else None."""
    if not transformer_engine_available():
        return None
    from megatron.core.extensions.transformer_engine import TEDotProductAttention  # optional GPU dependency

    return TEDotProductAttention


def cp_attention_available() -> bool:
    """A CP-aware attention module can be built for `--cp-comm-type p2p/all_gather/a2a`."""
    return default_cp_attention() is not None


class DiffMapsWithCP(MegatronModule):
    """`softmax(Q1 K1^T s) V - lam softmax(Q2 K2^T s) V` for this CP rank's tokens, CP done by the maps.

    `attention_cls` takes TEDotProductAttention's constructor keywords (None: `default_cp_attention()`).
    In: megatron-core's per-partition sub-heads on this rank's load-balanced tokens, query
    `[s/cp, b, h + n, d]` (groups `[signal x r, noise]`), key/value `[s/cp, b, 2g, d]`. Out:
    `[s/cp, b, h, 2d]` (before the head norm).
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
        attention_cls: type[torch.nn.Module] | None = None,
    ) -> None:
        super().__init__(config=config)
        attention_cls = attention_cls or default_cp_attention()
        if attention_cls is None:
            raise DiffmegError(
                f"--cp-comm-type {cp_comm_type} runs megatron-core's TEDotProductAttention, which needs "
                f"transformer_engine and a CUDA GPU; use --cp-comm-type ulysses"
            )
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
        self.noise_ratio = config.noise_ratio
        # Each call is an ordinary attention over the g KV heads of one map: the h signal queries over K1,
        # the n noise queries over K2 (n = h for the 1:1 DIFF).
        kwargs = dict(
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
        self.map1 = attention_cls(config=self._map_config(config, config.num_diff_heads), **kwargs)
        self.map2 = attention_cls(config=self._map_config(config, config.noise_heads), **kwargs)

    @staticmethod
    def _map_config(config, query_heads: int):
        """The config of one map's call: `query_heads` query heads over the g KV heads, no dropout."""
        map_config = copy.copy(config)
        map_config.num_attention_heads = query_heads
        map_config.num_query_groups = config.num_query_groups // 2
        map_config.num_noise_heads = None
        map_config.attention_dropout = 0.0
        return map_config

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
        b, d = query.shape[1], self.head_dim
        sk, g = key.shape[0], key.shape[2] // 2
        # Groups [signal x r, noise]: [s, b, h + n, d] -> Q1 [s, b, h, d] (signal), Q2 [s, b, n, d] (noise)
        q1, q2 = (t.contiguous() for t in split_query_heads(query, self.noise_ratio))
        k = key.view(sk, b, g, 2, d)
        v = value.reshape(sk, b, g, 2 * d).contiguous()  # V of KV head j: sub-heads 2j, 2j+1 side by side
        k1, k2 = k[..., 0, :].contiguous(), k[..., 1, :].contiguous()  # [sk, b, g, d]
        o1 = self._attend(self.map1, q1, k1, v)  # [s, b, h, 2d]
        o2 = self._attend(self.map2, q2, k2, v)  # [s, b, n, 2d]
        s, h, n = o1.shape[0], o1.shape[2], o2.shape[2]
        # signal head j against its group's noise head: [s, b, n, r, 2d] - lam [s, b, n, 1, 2d]
        out = o1.view(s, b, n, h // n, 2 * d) - lam.to(o1.dtype) * o2.view(s, b, n, 1, 2 * d)
        return out.view(s, b, h, 2 * d)
