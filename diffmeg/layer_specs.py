"""ModuleSpecs that plug differential attention into megatron-core's `TransformerLayer`.

Both specs keep megatron-core's layer (pre-norm, fused QKV, RoPE, SwiGLU MLP, residuals) and swap only
the attention core. The baseline Transformer (`diff_attention=False`) keeps megatron-core's own core.
Checkpoint keys of the local and TE specs agree (megatron-core maps the fused-norm names), so a run can
move between CPU and GPU.
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from diffmeg.attention import DiffCoreAttention, DiffCoreAttentionSubmodules, SDPACoreAttention
from diffmeg.config import DiffTransformerConfig
from diffmeg.errors import DiffmegError
from diffmeg.norm import RMSNorm
from diffmeg.runtime import transformer_engine_available


def diff_core_attention_spec(cp_attention: type | None = None) -> ModuleSpec:
    """The differential core; `cp_attention` runs the maps for the TE context-parallel modes (None:
    megatron-core's TEDotProductAttention)."""
    return ModuleSpec(
        module=DiffCoreAttention, submodules=DiffCoreAttentionSubmodules(cp_attention=cp_attention)
    )


def get_diff_layer_local_spec(config: DiffTransformerConfig, cp_attention: type | None = None) -> ModuleSpec:
    """megatron-core modules only (runs on CPU and GPU), with our fp32 RMSNorm (SP-capable)."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    # Fused attention through torch SDPA for every non-DIFF core (megatron-core's local core materialises
    # the scores): the baseline then runs flash kernels as DIFF's backends do.
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if config.diff_attention:
        spec.submodules.self_attention.submodules.core_attention = diff_core_attention_spec(cp_attention)
    return spec


def get_diff_layer_te_spec(config: DiffTransformerConfig) -> ModuleSpec:
    """Transformer Engine linears with the input/pre-MLP RMSNorm fused in (FP8-capable)."""
    if not transformer_engine_available():
        raise DiffmegError(
            "the Transformer Engine spec needs transformer_engine and a CUDA GPU; use --spec local"
        )
    spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec())
    if config.diff_attention:
        spec.submodules.self_attention.submodules.core_attention = diff_core_attention_spec()
    return spec


def get_diff_block_spec(config: DiffTransformerConfig, use_te: bool, vp_stage: int | None = None):
    """Block spec for this pipeline stage: its layers plus the final norm."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        layer, final_norm = get_diff_layer_te_spec(config), TENorm
    else:
        layer, final_norm = get_diff_layer_local_spec(config), RMSNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm)
