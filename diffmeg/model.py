"""megatron-core's `GPTModel` built from our specs: RMSNorm, SwiGLU, no biases, RoPE, untied output.

`DiffGPTModel` is megatron-core's GPTModel with one more way to compute the training loss: with
`config.cross_entropy_chunk_size` set, the output projection and cross entropy run in chunks of tokens
(`diffmeg.cross_entropy`) instead of materialising the whole logits. Everything else (parameters,
checkpoints, logits when no labels are given) is megatron-core's.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from diffmeg import runtime
from diffmeg.config import DiffTransformerConfig
from diffmeg.cross_entropy import linear_cross_entropy
from diffmeg.errors import DiffmegError
from diffmeg.init import initialize_parameters
from diffmeg.layer_specs import get_diff_block_spec


class DiffGPTModel(GPTModel):
    """GPTModel whose loss (labels given) can skip the full logits: see `diffmeg.cross_entropy`."""

    def _postprocess(self, hidden_states, *args, labels=None, inference_context=None, **kwargs):
        chunk_size = getattr(self.config, "cross_entropy_chunk_size", None)
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
) -> GPTModel:
    """This pipeline stage's part of the model, initialised independently of the parallel layout.

    Needs `diffmeg.runtime.setup()` (and megatron-core's parallel state) first: building a model never
    patches the process itself.
    """
    if not runtime.is_setup():
        raise DiffmegError("call diffmeg.runtime.setup() (or single_process()) before building a model")
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = DiffGPTModel(
        config=config,
        transformer_layer_spec=get_diff_block_spec(config, use_te=use_te),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        parallel_output=True,
    )
    if not config.use_cpu_initialization and torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    initialize_parameters(model, config, seed)
    return model


def lambda_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Current lambda of every differential layer, keyed by global layer number (for logs and tests)."""
    from diffmeg.attention import DiffCoreAttention

    return {
        f"layer{m.layer_number}": m.lambda_full().detach()
        for m in model.modules()
        if isinstance(m, DiffCoreAttention)
    }
