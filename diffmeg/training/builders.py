"""From resolved arguments to the config, the wrapped model, optimizer and scheduler of a training run."""

from __future__ import annotations

from megatron.core.transformer.module import Float16Module

from diffmeg.fusions.grad_accum import require_main_grad
from diffmeg.model import build_model, transformer_config
from diffmeg.run_config import RunConfig
from diffmeg.training.ddp import (
    clear_schedule_hooks,
    ddp_config,
    remove_param_gather_hooks,
    set_schedule_hooks,
    wrap_model_chunks,
)
from diffmeg.training.grads import finalize_diff_model_grads
from diffmeg.training.graphs import compile_layers
from diffmeg.training.optim import build_optimizer, build_scheduler


def build_training_objects(run: RunConfig):
    """(config, model chunks, optimizer, scheduler) for this rank; parallel state must be initialised.

    The model is a list of DDP-wrapped chunks: one, or one per virtual pipeline stage under the
    interleaved schedule (Megatron-LM's `model` list). The TransformerConfig comes from
    `transformer_config`, the one mapping of a run's fields to megatron-core's config that the offline
    readers (conversion, single-rank models of checkpoints) share with training.
    """
    model_fields, training = run.model, run.training
    config = transformer_config(run)
    chunks = []
    stages = range(run.parallel.model_chunks) if run.parallel.model_chunks > 1 else [None]  # None: no VP
    for vp_stage in stages:
        chunk = build_model(
            config,
            vocab_size=model_fields.vocab_size,
            max_sequence_length=model_fields.max_position_embeddings,
            rotary_base=model_fields.rotary_base,
            use_te=model_fields.transformer_impl == "transformer_engine",
            seed=training.seed,
            vp_stage=vp_stage,
        )
        if training.compile_layers:
            compile_layers([chunk])  # from outside the model code, before any wrapper
        chunks.append(Float16Module(config, chunk) if training.bf16 or training.fp16 else chunk)
    model = wrap_model_chunks(config, ddp_config(run), chunks)
    if config.gradient_accumulation_fusion:
        require_main_grad(model)
    optimizer = build_optimizer(run, model)
    scheduler = build_scheduler(run, optimizer)
    config.finalize_model_grads_func = finalize_diff_model_grads
    set_schedule_hooks(config, model)
    config.grad_scale_func = optimizer.scale_loss
    return config, model, optimizer, scheduler


def release_training_objects(config, model: list) -> None:
    """Undo what `build_training_objects` hooked up, so that dropping the model and optimizer frees them
    in a process that goes on (benchmarks and tools that build one run after another): the parameter
    gather pre-hooks (`remove_param_gather_hooks` says what they would keep alive) and the config's
    callbacks into the model chunks and the optimizer. The objects cannot train afterwards."""
    remove_param_gather_hooks(model)
    clear_schedule_hooks(config)
    config.finalize_model_grads_func = config.grad_scale_func = None
