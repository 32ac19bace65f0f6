"""megatron-core's `SelfAttention` for the differential cores: what both DIFF versions change around it.

megatron-core sizes its output projection for `num_attention_heads x d` columns and lays its fused QKV
weight out as `num_query_groups` blocks of `[num_attention_heads / num_query_groups query heads, 1 key,
1 value]`. DIFF feeds the output projection its h combined heads, h x 2d (V1) or h x d (V2), which is
megatron-core's width only for the 1:1 V1; and V1's grouped differential attention (GDA) puts h + n query
sub-heads over 2g K/V sub-groups, which need not divide (Motif-2-12.7B: 40 over 16). `DiffSelfAttention`
keeps everything else of megatron-core's (QKV projection, RoPE, KV cache, sequence parallelism, the core
as a spec submodule) and changes those two:
- `linear_proj` is built for the combined heads' width;
- where the query heads do not divide the groups, group m of the fused QKV holds the query heads
  `config.query_heads_per_subgroup` gives it (megatron-core's layout wherever they divide, so the 1:1
  models and their checkpoints are unchanged).
DIFF V1 uses it as is (`DiffCoreAttention` its core); DIFF V2's `DiffV2SelfAttention` extends it.
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import build_module

from diffmeg.config import query_heads_per_subgroup
from diffmeg.errors import DiffmegError


class DiffSelfAttention(SelfAttention):
    """megatron-core's SelfAttention with `linear_proj` from the h combined heads of width
    `head_width * d` and the fused QKV of any query-head count."""

    head_width = 2
    """Width of one combined head in units of d: V1's heads carry a V of 2d."""

    def __init__(
        self,
        config,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection)
        width = config.num_diff_heads * self.head_width * config.kv_channels
        if width != self.query_projection_size:  # megatron-core sized it for num_attention_heads x d
            self.linear_proj = build_module(
                submodules.linear_proj,
                width,
                config.hidden_size,
                config=config,
                init_method=config.output_layer_init_method,
                bias=config.add_bias_linear,
                input_is_parallel=True,
                skip_bias_add=True,
                is_expert=False,
                tp_comm_buffer_name="proj",
                tp_group=self.pg_collection.tp,
            )
        heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        self.query_heads_per_group: list[int] | None = None
        """This rank's query heads in each of its groups of the fused QKV, where they do not divide evenly
        (None: megatron-core's layout)."""
        if heads % groups:
            self.query_heads_per_group = query_heads_per_subgroup(heads, groups)

    def get_query_key_value_tensors(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ):
        if self.query_heads_per_group is None:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate, split_qkv
            )
        if key_value_states is not None or output_gate or not split_qkv:
            raise DiffmegError(
                "grouped differential attention with query heads that do not divide the K/V groups has no "
                "cross attention, output gate or fused QKV RoPE"
            )
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, (heads + 2 groups) d] of this rank
        d = self.hidden_size_per_attention_head
        sizes = [n for count in self.query_heads_per_group for n in (count * d, d, d)]
        pieces = torch.split(mixed, sizes, dim=-1)  # per group: its query heads, its key, its value
        s, b = mixed.shape[:2]
        # [s, b, count_m d] for each group m -> [s, b, heads, d]
        query = torch.cat(pieces[0::3], dim=-1).view(s, b, self.num_attention_heads_per_partition, d)
        key = torch.stack(pieces[1::3], dim=2)  # [s, b, groups, d]
        value = torch.stack(pieces[2::3], dim=2)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value
