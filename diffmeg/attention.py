"""Differential attention as megatron-core's `core_attention` submodule.

megatron-core's `SelfAttention` keeps doing the fused QKV projection, RoPE, the KV cache and the
output projection; this module receives its per-partition q/k/v and returns the concatenated heads:

    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init
    head_i = RMSNorm((softmax(Q1 K1^T / sqrt d) - lambda softmax(Q2 K2^T / sqrt d)) V) * (1 - lambda_init)

Grouped differential attention (GDA, Motif-2-12.7B's form; `config.num_noise_heads` n): the query
sub-heads come in n groups `[signal x r, noise]` (r = h / n), and signal head j's Q2 is its group's noise
query, so `softmax(Q2 K2^T)` is one map per group; each KV head's K1/K2 pair and V of 2d serve n / g groups.
The output projection takes the h signal heads of 2d (`diffmeg.self_attention.DiffSelfAttention`).

The lambda vectors and the head-norm weight are replicated on every tensor-parallel rank while each
rank only sees its own heads, so their gradients are partial sums: they carry
`SUM_GRAD_OVER_TP_ATTR` and `diffmeg.training.grads.finalize_diff_model_grads` sums them over TP once
per step.

Context parallelism (`cp_comm_type`): `ulysses` trades this rank's sequence shard for whole heads with an
all-to-all around the backend; `p2p` / `all_gather` / `a2a` hand the two maps to megatron-core's
TEDotProductAttention, which does its own CP (`diffmeg.parallel.DiffMapsWithCP`; the attention class is
the spec's `cp_attention` submodule).

`override_attention_backend` is the public way for analysis tools to run their own attention math
(e.g. one that reports both maps) in place of the configured backend for a `with` block, in the
differential cores and in the SDPA cores of every other attention.

`SDPACoreAttention` (`diffmeg.core_attention`) is the core the local spec gives every other attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from diffmeg.collectives import SUM_GRAD_OVER_TP_ATTR
from diffmeg.config import DiffTransformerConfig
from diffmeg.core_attention import CoreAttention, SDPACoreAttention, SDPAFn
from diffmeg.errors import DiffmegError
from diffmeg.fusions.diff_combine import diff_epilogue
from diffmeg.fusions.rms_norm import HeadRMSNorm
from diffmeg.kernels import DiffAttentionFn, split_query_heads
from diffmeg.kernels.reference import diff_attention_reference
from diffmeg.parallel import DiffMapsWithCP, head_to_sequence_shards, sequence_to_head_shards
from diffmeg.registry import entry, resolve, select

logger = logging.getLogger(__name__)



@dataclass
class DiffCoreAttentionSubmodules:
    """What the spec chooses for the differential core."""

    cp_attention: type[torch.nn.Module] | None = None
    """The CP-aware attention that runs each map for `cp_comm_type` p2p/all_gather/a2a (with
    TEDotProductAttention's constructor and call signature); None: TEDotProductAttention where TE runs."""


class DiffCoreAttention(CoreAttention):
    """Differential attention core: q/k/v per partition in, `[sq, b, h_p * 2d]` out. Query sub-heads
    come group by group, `[signal x r, noise]` (r = 1: Q1/Q2 pairs; r > 1: grouped differential attention,
    each noise map computed once for its group's r signal heads)."""

    name = "differential attention"

    override: DiffAttentionFn | None = None
    """When set, every call of this layer uses it instead of the configured backend (see
    `override_attention_backend`)."""

    def __init__(
        self,
        config: DiffTransformerConfig,
        *args,
        pg_collection: ProcessGroupCollection | None = None,
        submodules: DiffCoreAttentionSubmodules | None = None,
        **kwargs,
    ) -> None:
        """megatron-core's core-attention keywords (`CoreAttention`), plus the CP attention to use."""
        if not isinstance(config, DiffTransformerConfig) or not config.diff_attention:
            raise DiffmegError("DiffCoreAttention needs a DiffTransformerConfig with diff_attention=True")
        super().__init__(config, *args, **kwargs)
        submodules = submodules or DiffCoreAttentionSubmodules()
        cp_group = getattr(pg_collection, "cp", None)
        if cp_group is None and config.context_parallel_size > 1:
            cp_group = parallel_state.get_context_parallel_group()
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        # Ulysses all-to-all here, or megatron-core's TE attention doing its own CP (p2p, all_gather, a2a).
        self.cp_comm_type = self.cp_comm_type or config.cp_comm_type or "ulysses"
        self.head_dim = config.kv_channels
        self.lambda_init = config.lambda_init_at(self.layer_number)
        self.noise_ratio = config.noise_ratio  # r signal heads per noise head (1: the paper's pairs)
        # A name this installation can never run fails at build; every backend left runs on any device
        # (loaded here, outside any compiled region), so a core built on the CPU runs on the GPU too.
        self.diff_attn_backend = resolve("diff_attention", config.diff_attn_backend)
        self._backend_fn: DiffAttentionFn = entry("diff_attention", self.diff_attn_backend).load()
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else "cuda"

        # lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init, vectors of size d shared by the layer's heads.
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            p = torch.nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32, device=device))
            if config.perform_initialization:
                torch.nn.init.normal_(p, mean=0.0, std=config.lambda_std)
            setattr(p, SUM_GRAD_OVER_TP_ATTR, True)
            self.register_parameter(name, p)
        norm_fn = select("norm", config.norm_impl, spec="local").load().norm_fn
        self.head_norm = HeadRMSNorm(2 * self.head_dim, config.head_norm_eps, norm_fn=norm_fn)
        setattr(self.head_norm.weight, SUM_GRAD_OVER_TP_ATTR, True)
        self.head_norm.to(device)
        self.cp_maps = None
        if self.cp_group is not None and self.cp_comm_type != "ulysses":
            pgs = pg_collection if getattr(pg_collection, "cp", None) is not None else None
            self.cp_maps = DiffMapsWithCP(
                config,
                self.layer_number,
                self.attn_mask_type,
                self.attention_type,
                self.softmax_scale,
                self.cp_comm_type,
                pgs,
                attention_cls=submodules.cp_attention,
            )

    def lambda_full(self) -> torch.Tensor:
        """The scalar lambda of this layer (fp32 or wider, differentiable in the four vectors)."""
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        lam1 = torch.exp(torch.dot(self.lambda_q1.to(dtype), self.lambda_k1.to(dtype)))
        lam2 = torch.exp(torch.dot(self.lambda_q2.to(dtype), self.lambda_k2.to(dtype)))
        return lam1 - lam2 + self.lambda_init

    def attend(self, query, key, value, attention_mask, attn_mask_type) -> torch.Tensor:  # CoreAttention's
        if self.cp_maps is not None:
            # megatron-core's CP inside TE attention: this rank's load-balanced tokens in and out.
            if attention_mask is not None or (self.training and self.dropout_p > 0.0):
                raise DiffmegError(
                    f"cp_comm_type {self.cp_comm_type} supports causal attention without dropout only"
                )
            out = self.cp_maps(query, key, value, self.lambda_full())  # [s/cp, b, h, 2d]
            out = self.head_norm(out) * (1.0 - self.lambda_init)
            return out.reshape(out.shape[0], out.shape[1], -1)
        cp_group = self.cp_group
        if cp_group is not None:
            # Ulysses: trade sequence shards for head shards (whole heads and K1/K2 pairs per rank).
            query, key, value = (sequence_to_head_shards(t, cp_group) for t in (query, key, value))
        b, sk = query.shape[1], key.shape[0]
        g, d = key.shape[2] // 2, self.head_dim
        # [sq, b, h + n, d] -> signal [sq, b, h, d] and noise [sq, b, n, d] -> [b, h|n, sq, d]
        q = [t.permute(1, 2, 0, 3) for t in split_query_heads(query, self.noise_ratio)]
        # [sk, b, 2g, d] -> [sk, b, g, 2, d] -> [2, b, g, sk, d] for K1, K2
        k = key.view(sk, b, g, 2, d).permute(3, 1, 2, 0, 4)
        # V of head pair j is sub-heads 2j, 2j+1 side by side: [sk, b, 2g, d] -> [b, g, sk, 2d]
        v = value.reshape(sk, b, g, 2 * d).permute(1, 2, 0, 3)
        mask = attention_mask  # None in training (causal); megatron's inference paths may pass one

        dropout_p = self.dropout_p if self.training else 0.0
        if self.override is not None:
            backend = self.override
        elif mask is not None or dropout_p > 0.0:
            # The fused paths are causal-only and would drop A1 and A2 separately: use the exact math.
            backend = diff_attention_reference
        else:
            backend = self._backend_fn
        kwargs = {"attention_mask": mask} if mask is not None else {}
        with self.dropout_rng(), self.sdpa_context():  # the SDPA backend's calls take the preference
            out = backend(
                q[0], q[1], k[0], k[1], v, self.lambda_full(), scale=self.softmax_scale, dropout_p=dropout_p,
                **kwargs,
            )  # fmt: skip
        # out: [b, h, sq, 2d] -> [sq, b, h, 2d], normed and scaled
        norm = self.head_norm
        out = diff_epilogue(out, norm.weight, norm.eps, 1.0 - self.lambda_init, norm=norm.norm_fn)
        if cp_group is not None:
            out = head_to_sequence_shards(out, cp_group)  # [sq/cp, b, h*cp, 2d]
        # [sq', b, h', 2d] -> [sq', b, h' * 2d]
        return out.reshape(out.shape[0], b, -1)


@contextmanager
def override_attention_backend(
    model: torch.nn.Module,
    backend_for_layer: Callable[[int], DiffAttentionFn],
    sdpa_for_layer: Callable[[int], SDPAFn] | None = None,
) -> Iterator[None]:
    """Within the block, the differential core of layer i (0-based global layer index) attends with
    `backend_for_layer(i)`, a function with the backends' signature (`diffmeg.kernels`), for every call
    (also those with masks or dropout); with `sdpa_for_layer`, an `SDPACoreAttention` of layer i (the
    Transformer baseline's, DIFF V2's) calls `sdpa_for_layer(i)` in place of torch's SDPA. Restored on
    exit."""
    cores = [m for m in model.modules() if isinstance(m, DiffCoreAttention)]
    if sdpa_for_layer is not None:
        cores += [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    saved = [core.override for core in cores]
    try:
        for core in cores:
            make = backend_for_layer if isinstance(core, DiffCoreAttention) else sdpa_for_layer
            core.override = make(core.layer_number - 1)
        yield
    finally:
        for core, previous in zip(cores, saved, strict=True):
            core.override = previous
