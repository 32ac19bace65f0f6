"""DIFF V2: differential attention over ordinary GQA attention, as megatron-core's `SelfAttention`.

The authors' second version (unilm `Diff-Transformer/Diff-Transformer-V2`) keeps a standard attention
kernel: 2h query heads of d attend over g KV heads (query head j uses KV head j // (2h/g), so heads 2i
and 2i+1 share K and V), and head i's output is

    out_i = attn[2i] - sigmoid(lambda_proj(x))_i * attn[2i+1]          (width d)

with a per-token, per-head lambda from a bias-free projection of the attention input x. No head
RMSNorm, no `(1 - lambda_init)`, no lambda reparameterisation. The output projection maps h x d back.

In megatron-core this is `SelfAttention` configured with `num_attention_heads = 2h` and
`num_query_groups = g` (`diffmeg.config.megatron_head_counts`): its fused QKV projection, RoPE, KV
cache, sequence parallelism and *its own core attention* (DotProductAttention, torch SDPA, or TE's
fused attention with all of megatron-core's context-parallel modes) run unchanged. This subclass adds
`linear_lambda` (column-parallel over heads; under sequence parallelism its input is gathered like
QKV's), sizes `linear_proj` for h x d (`DiffSelfAttention`), and combines each head pair right before
`linear_proj`. Pairs never straddle tensor-parallel ranks: a rank holds 2h/tp consecutive query heads and
h/tp lambdas.

Grouped differential attention (GDA, Motif-3's form; `config.num_noise_heads` n): h + n query heads laid
out group by group `[signal x r, noise]` (r = h / n; r = 1 is the pairs above), a group's r + 1 heads within
one KV head (n a multiple of g); signal head j = g r + i outputs `attn[signal j] - lambda_j attn[noise g]`.
A rank holds whole groups: (h + n)/tp query heads and their h/tp lambdas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from diffmeg.errors import DiffmegError
from diffmeg.fusions.diff_combine import combine_head_groups
from diffmeg.self_attention import DiffSelfAttention


@dataclass
class DiffV2SelfAttentionSubmodules(SelfAttentionSubmodules):
    """megatron-core's self-attention submodules plus the lambda projection."""

    linear_lambda: ModuleSpec | type = None
    """hidden -> h (no bias), column-parallel over heads."""


class DiffV2SelfAttention(DiffSelfAttention):
    """megatron-core's SelfAttention with DIFF V2's combination of each group's heads and per-token lambda."""

    head_width = 1  # a combined head is d wide

    def __init__(
        self,
        config,
        submodules: DiffV2SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection)
        self.noise_ratio = config.noise_ratio
        if self.num_attention_heads_per_partition % (self.noise_ratio + 1):
            raise DiffmegError(
                "DIFF V2 needs whole groups of signal heads and their noise head on every tensor-parallel "
                "rank"
            )
        output_heads = config.num_diff_heads
        self.linear_lambda = build_module(
            submodules.linear_lambda,
            config.hidden_size,
            output_heads,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="lambda",
            tp_group=self.pg_collection.tp,
        )
        # The combination runs on linear_proj's input on every path of SelfAttention.forward (training,
        # KV-cache decoding, selective recompute of the core), with this forward's lambda.
        self.linear_proj.register_forward_pre_hook(self._combine_before_projection)
        self.lam: torch.Tensor | None = None
        """This forward's lambda, `lambda_values` [s, b, h/tp] (None outside forward): what the combination,
        and the attention analysis (`diffmeg.eval.capture`), read."""

    def lambda_values(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """sigmoid(lambda_proj(x)) in fp32 or wider: [s, b, hidden] -> [s, b, h/tp] (all tokens under SP)."""
        logits, _ = self.linear_lambda(hidden_states)
        return torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))

    def forward(self, hidden_states: torch.Tensor, attention_mask, *args, **kwargs):
        self.lam = self.lambda_values(hidden_states)
        try:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        finally:
            self.lam = None

    def _combine_before_projection(self, module: torch.nn.Module, args: tuple) -> tuple:
        if self.lam is None:
            raise DiffmegError("DIFF V2's output projection ran outside DiffV2SelfAttention.forward")
        attn = args[0]  # [s, b, (h + n)/tp * d]
        if attn.shape[:2] != self.lam.shape[:2]:
            raise DiffmegError(
                f"DIFF V2: attention output {tuple(attn.shape)} and lambda {tuple(self.lam.shape)} "
                f"cover different tokens (packed sequences are not supported)"
            )
        return (combine_head_groups(attn, self.lam, self.noise_ratio), *args[1:])
