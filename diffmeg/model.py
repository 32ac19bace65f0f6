"""megatron-core's `GPTModel` built from our specs: RMSNorm, SwiGLU, no biases, RoPE; the output layer is
its own matrix, or tied to the word embedding (`config.share_embeddings_and_output_weights`).

`transformer_config` is the one mapping of a run's fields to the model config, from a `RunConfig`: the
training run's, or one the offline readers (single-rank models of checkpoints, conversion) build from
flat arguments (a checkpoint's upgraded args.json: `RunConfig.from_args(args, partial=True)`).

`DiffGPTModel` is megatron-core's GPTModel with one more way to compute the training loss: with
`config.cross_entropy_chunk_size` set, the output projection and cross entropy run in chunks of tokens
(`diffmeg.fusions.cross_entropy`) instead of materialising the whole logits. Everything else (parameters,
checkpoints, logits when no labels are given) is megatron-core's.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from diffmeg import runtime
from diffmeg.attention import DiffCoreAttention
from diffmeg.compat import graph_safe_rng_is_te
from diffmeg.config import DiffTransformerConfig, megatron_head_counts
from diffmeg.errors import DiffmegError
from diffmeg.fusions import grad_accum
from diffmeg.fusions.cross_entropy import linear_cross_entropy
from diffmeg.init import initialize_parameters
from diffmeg.layer_specs import get_diff_block_spec
from diffmeg.run_config import RunConfig

# megatron-core's FusedScaleMaskSoftmax imports these CUDA extensions (Megatron-LM's / apex's fused kernels)
# when the fusion is on and the shapes qualify (bf16/fp16, 16 < sk <= 4096): without them every local-spec
# Transformer run on a GPU would stop with ModuleNotFoundError.
FUSED_SOFTMAX_MODULES = (
    "scaled_upper_triang_masked_softmax_cuda",
    "scaled_masked_softmax_cuda",
    "scaled_softmax_cuda",
)


def fused_softmax_available() -> bool:
    """megatron-core's fused masked softmax can run here: CUDA and its extension modules importable."""
    if not torch.cuda.is_available():
        return False
    return all(importlib.util.find_spec(name) is not None for name in FUSED_SOFTMAX_MODULES)


def transformer_config(run: RunConfig) -> DiffTransformerConfig:
    """The LLaMA macro layout (pre-RMSNorm, SwiGLU, no biases) with the run's sizes and parallelism."""
    model, parallel, training = run.model, run.parallel, run.training
    on_gpu = torch.cuda.is_available()
    noise = model.num_noise_heads if model.diff_attention else None
    heads, groups = megatron_head_counts(
        model.num_attention_heads, model.num_query_groups, model.diff_attention, model.diff_version, noise
    )
    dtype = training.params_dtype
    vp = parallel.virtual_pipeline_model_parallel_size
    return DiffTransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        # Megatron-LM's interleaved-schedule p2p: overlapped isend/irecv (batched p2p cannot overlap).
        overlap_p2p_comm=vp is not None,
        batch_p2p_comm=vp is None,
        context_parallel_size=parallel.context_parallel_size,
        cp_comm_type=parallel.cp_comm_type,
        sequence_parallel=parallel.sequence_parallel,
        share_embeddings_and_output_weights=bool(model.tie_embeddings_and_output_weights),
        deterministic_mode=training.deterministic_mode,
        use_cpu_initialization=not on_gpu,
        # megatron-core sets the TP attributes inside its init; diffmeg.init then redraws every parameter
        # layout-independently.
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=training.bf16,
        fp16=training.fp16,
        fp8=training.fp8_format,
        fp8_recipe=training.fp8_recipe,
        recompute_granularity=training.recompute_granularity,
        recompute_method=training.recompute_method,
        recompute_num_layers=training.recompute_num_layers,
        masked_softmax_fusion=fused_softmax_available(),
        bias_activation_fusion=on_gpu,
        apply_rope_fusion=False,
        diff_attention=model.diff_attention,
        diff_version=model.diff_version,
        num_noise_heads=noise,
        lambda_init=model.lambda_init,
        lambda_std=model.lambda_std,
        mlp_activation=model.mlp_activation,
        diff_attn_backend=run.impls["diff_attn_backend"],
        cross_entropy_chunk_size=training.cross_entropy_chunk_size,
        cross_entropy_loss_fusion=training.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl="native",
        gradient_accumulation_fusion=training.gradient_accumulation_fusion,
        norm_impl=run.impls["norm_impl"],
        sdpa_backend=run.impls["sdpa_backend"],
        # megatron-core's local CUDA graphs: each layer whole (scope "full"), the RNG tracker graph-safe
        # (diffmeg.compat seeds it so for such runs; TE's tracker where TE is installed, as Megatron-LM)
        cuda_graph_impl=training.cuda_graph_impl,
        use_te_rng_tracker=training.cuda_graph_impl != "none" and graph_safe_rng_is_te(),
    )


class DiffGPTModel(GPTModel):
    """GPTModel whose loss (labels given) can skip the full logits: see `diffmeg.fusions.cross_entropy`."""

    def _postprocess(self, hidden_states, *args, labels=None, inference_context=None, **kwargs):
        chunk_size = getattr(self.config, "cross_entropy_chunk_size", None)
        # unchunked: megatron-core's loss, fused or not (`compute_language_model_loss` reads its config's
        # `cross_entropy_loss_fusion`, megatron-core's own switch)
        if not chunk_size or not self.post_process or labels is None or inference_context is not None:
            return super()._postprocess(
                hidden_states, *args, labels=labels, inference_context=inference_context, **kwargs
            )
        # The output layer's weight as GPTModel picks it (the embedding's when shared), its TP split and
        # sequence-parallel input; the per-token loss [b, s] equals compute_language_model_loss's.
        weight = self.output_layer.weight
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
        return linear_cross_entropy(
            hidden_states,
            weight,
            labels,
            chunk_size,
            sequence_parallel=self.output_layer.sequence_parallel,
            tp_group=self.output_layer.tp_group,
        )


def build_model(
    config: DiffTransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    rotary_base: float = 10000,
    use_te: bool = False,
    seed: int = 1234,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
) -> GPTModel:
    """This pipeline stage's part of the model, initialised independently of the parallel layout.

    `vp_stage`: which model chunk (virtual pipeline stage) of this rank to build under the interleaved
    schedule (`config.virtual_pipeline_model_parallel_size` set); its layers carry their global numbers.
    Needs `diffmeg.runtime.setup()` (and megatron-core's parallel state) first: building a model never
    patches the process itself.
    """
    if not runtime.is_setup():
        raise DiffmegError("call diffmeg.runtime.setup() (or single_process()) before building a model")
    if config.gradient_accumulation_fusion:  # megatron-core's linears check for its extension at init
        grad_accum.install()
    whole_rank = vp_stage is None  # else: the first/last stage is this chunk only if it is the first/last
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=whole_rank, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=whole_rank, vp_stage=vp_stage)
    model = DiffGPTModel(
        config=config,
        transformer_layer_spec=get_diff_block_spec(config, use_te=use_te, vp_stage=vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        parallel_output=True,
        vp_stage=vp_stage,
    )
    if not config.use_cpu_initialization and torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    initialize_parameters(model, config, seed)
    return model


def output_logits(model: GPTModel, hidden: torch.Tensor) -> torch.Tensor:
    """The output layer applied to final hidden states [s, b, h] -> logits [s, b, V / TP], with the
    embedding's weight when the two are tied (the tied output layer holds no weight of its own)."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight)
    return logits


def lambda_parameters(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Current lambda of every differential layer of a model or of its chunks (virtual pipeline stages),
    keyed by global layer number (for logs and tests)."""
    chunks = model if isinstance(model, list) else [model]
    return {
        f"layer{m.layer_number}": m.lambda_full().detach()
        for chunk in chunks
        for m in chunk.modules()
        if isinstance(m, DiffCoreAttention)
    }
