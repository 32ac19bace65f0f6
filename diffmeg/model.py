"""megatron-core's `GPTModel` built from our specs: RMSNorm, SwiGLU, no biases, RoPE, untied output."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from diffmeg import runtime
from diffmeg.config import DiffTransformerConfig
from diffmeg.errors import DiffmegError
from diffmeg.init import initialize_parameters
from diffmeg.layer_specs import get_diff_block_spec


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
    whole_rank = vp_stage is None  # else: the first/last stage is this chunk only if it is the first/last
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=whole_rank, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=whole_rank, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_diff_block_spec(config, use_te=use_te, vp_stage=vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        parallel_output=True,
        vp_stage=vp_stage,
    )
    if not config.use_cpu_initialization and torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    initialize_parameters(model, config, seed)
    return model


def lambda_parameters(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Current lambda of every differential layer of a model or of its chunks (virtual pipeline stages),
    keyed by global layer number (for logs and tests)."""
    from diffmeg.attention import DiffCoreAttention

    chunks = model if isinstance(model, list) else [model]
    return {
        f"layer{m.layer_number}": m.lambda_full().detach()
        for chunk in chunks
        for m in chunk.modules()
        if isinstance(m, DiffCoreAttention)
    }
