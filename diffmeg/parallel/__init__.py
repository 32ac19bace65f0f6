"""Context parallelism for long sequences: one layout check, two ways to attend across CP ranks.

- `ulysses` (the DIFF default, no TE): an all-to-all around the differential core trades this rank's
  sequence shard for whole heads over the full sequence (`diffmeg.parallel.ulysses`; `UlyssesAttention`
  wraps megatron-core's own core attention the same way, for DIFF V2).
- `p2p` / `all_gather` / `a2a`: megatron-core's TEDotProductAttention does CP itself, once per
  differential map (`diffmeg.parallel.te_attention`).
"""

from diffmeg.parallel.te_attention import DiffMapsWithCP, cp_attention_available, default_cp_attention
from diffmeg.parallel.ulysses import (
    UlyssesAttention,
    UlyssesAttentionSubmodules,
    cp_chunk_ids,
    head_to_sequence_shards,
    natural_order,
    sequence_to_head_shards,
    slice_sequence_for_cp,
)
from diffmeg.parallel.validation import CP_COMM_TYPES, TE_CP_COMM_TYPES, validate_cp

__all__ = [
    "CP_COMM_TYPES",
    "TE_CP_COMM_TYPES",
    "UlyssesAttention",
    "UlyssesAttentionSubmodules",
    "DiffMapsWithCP",
    "cp_attention_available",
    "cp_chunk_ids",
    "default_cp_attention",
    "head_to_sequence_shards",
    "natural_order",
    "sequence_to_head_shards",
    "slice_sequence_for_cp",
    "validate_cp",
]
