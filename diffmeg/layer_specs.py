"""ModuleSpecs that plug differential attention into megatron-core's `TransformerLayer`.

Both specs keep megatron-core's layer (pre-norm, fused QKV, RoPE, SwiGLU MLP, residuals). DIFF V1 swaps
the attention core (its self-attention is megatron-core's, with the output projection and fused QKV of
any noise-head count: `DiffSelfAttention`); DIFF V2 swaps the self-attention for `DiffV2SelfAttention`
(megatron-core's SelfAttention plus the lambda projection) and keeps megatron-core's core attention, so
TE's fused attention and its context-parallel modes apply. The baseline Transformer
(`diff_attention=False`) keeps megatron-core's own attention. Checkpoint keys of the local and TE specs
agree (megatron-core maps the fused-norm names), so a run can move between CPU and GPU.
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from diffmeg.attention import DiffCoreAttention, DiffCoreAttentionSubmodules
from diffmeg.attention_v2 import DiffV2SelfAttention, DiffV2SelfAttentionSubmodules
from diffmeg.config import DiffTransformerConfig
from diffmeg.errors import DiffmegError
from diffmeg.mlp import PolyNormMLP
from diffmeg.parallel import UlyssesAttention, UlyssesAttentionSubmodules
from diffmeg.registry import select
from diffmeg.runtime import transformer_engine_unavailable
from diffmeg.self_attention import DiffSelfAttention


def diff_core_attention_spec(cp_attention: type | None = None) -> ModuleSpec:
    """The differential core; `cp_attention` runs the maps for the TE context-parallel modes (None:
    megatron-core's TEDotProductAttention)."""
    return ModuleSpec(
        module=DiffCoreAttention, submodules=DiffCoreAttentionSubmodules(cp_attention=cp_attention)
    )


def diff_v2_attention_spec(
    config: DiffTransformerConfig, base: ModuleSpec, linear_lambda: type = ColumnParallelLinear
) -> ModuleSpec:
    """DIFF V2's self-attention from megatron-core's (`base`): same QKV, core and output linears, plus
    `linear_lambda`; under Ulysses context parallelism the core runs inside `UlyssesAttention`."""
    sub = base.submodules
    core = sub.core_attention
    if config.context_parallel_size > 1 and (config.cp_comm_type or "ulysses") == "ulysses":
        core = ModuleSpec(module=UlyssesAttention, submodules=UlyssesAttentionSubmodules(attention=core))
    return ModuleSpec(
        module=DiffV2SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=DiffV2SelfAttentionSubmodules(
            linear_qkv=sub.linear_qkv,
            core_attention=core,
            linear_proj=sub.linear_proj,
            q_layernorm=sub.q_layernorm,
            k_layernorm=sub.k_layernorm,
            linear_lambda=linear_lambda,
        ),
    )


def is_diff_v2(config: DiffTransformerConfig) -> bool:
    return config.diff_attention and config.diff_version == 2


def get_diff_layer_local_spec(config: DiffTransformerConfig, cp_attention: type | None = None) -> ModuleSpec:
    """megatron-core modules only (runs on CPU and GPU), with our RMSNorm (SP-capable; `norm_impl`'s)."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    norm = select("norm", config.norm_impl, spec="local").load()
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    # Fused attention through torch SDPA for every non-DIFF core (megatron-core's local core materialises
    # the scores): the baseline then runs flash kernels as DIFF's backends do.
    spec.submodules.self_attention.submodules.core_attention = select("core_attention", spec="local").load()
    if is_diff_v2(config):
        spec.submodules.self_attention = diff_v2_attention_spec(config, spec.submodules.self_attention)
    elif config.diff_attention:
        spec.submodules.self_attention.module = DiffSelfAttention
        spec.submodules.self_attention.submodules.core_attention = diff_core_attention_spec(cp_attention)
    return spec


def get_diff_layer_te_spec(config: DiffTransformerConfig) -> ModuleSpec:
    """Transformer Engine linears with the input/pre-MLP RMSNorm fused in (FP8-capable)."""
    if (reason := transformer_engine_unavailable(None)) is not None:
        raise DiffmegError(reason)
    spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec())
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = select("core_attention", spec="transformer_engine").load()
    if is_diff_v2(config):
        # optional GPU dependency: Transformer Engine, checked just above
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

        # The lambda projection reads the normed input, so the input norm cannot stay fused into QKV's
        # linear: TE's norm, then plain TE linears; checkpoint keys stay those of the fused layout.
        spec.submodules.input_layernorm = TENorm
        spec.submodules.self_attention.submodules.linear_qkv = TEColumnParallelLinear
        spec.submodules.sharded_state_dict_keys_map = {
            **spec.submodules.sharded_state_dict_keys_map,
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        }
        spec.submodules.self_attention = diff_v2_attention_spec(
            config, spec.submodules.self_attention, linear_lambda=TEColumnParallelLinear
        )
    elif config.diff_attention:
        spec.submodules.self_attention.module = DiffSelfAttention
        spec.submodules.self_attention.submodules.core_attention = diff_core_attention_spec()
    return spec


def _with_mlp(layer: ModuleSpec, config: DiffTransformerConfig) -> ModuleSpec:
    """The layer spec with the MLP `config.mlp_activation` names (megatron-core's own for SwiGLU)."""
    if config.mlp_activation == "poly_norm":
        layer.submodules.mlp.module = PolyNormMLP
    return layer


def get_diff_block_spec(config: DiffTransformerConfig, use_te: bool, vp_stage: int | None = None):
    """Block spec for this pipeline stage: its layers plus the final norm. With `config.fp8` set, the local
    layer spec goes through the FP8 linear converter (`diffmeg.fusions.torchao_fp8`) before anything is
    built; the Transformer Engine spec's linears are TE's, which megatron-core runs in FP8 from the config."""
    if use_te:
        layer = _with_mlp(get_diff_layer_te_spec(config), config)
        final_norm = select("norm", spec="transformer_engine").load()
    else:
        layer = _with_mlp(get_diff_layer_local_spec(config), config)
        final_norm = select("norm", config.norm_impl, spec="local").load()
        if config.fp8:
            layer = select("fp8_linear", spec="local").load()(config).convert(layer)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm)
