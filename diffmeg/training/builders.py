"""From resolved arguments to the config, the wrapped model, optimizer and scheduler of a training run:
megatron-core's model chunks (each compiled with --compile-layers, wrapped in DDP), its optimizer (plain or
distributed, its step the registry's) and the LR/WD schedule."""

from __future__ import annotations

import torch
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from diffmeg import registry
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
    set_schedule_hooks(config, model)
    optimizer = build_optimizer(run, model)
    scheduler = build_scheduler(run, optimizer)
    config.finalize_model_grads_func = finalize_diff_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return config, model, optimizer, scheduler


def build_optimizer(run: RunConfig, model: list[torch.nn.Module]) -> MegatronOptimizer:
    """AdamW with fp32 main params; weight decay skips 1-D params (norms, lambda vectors) as in Megatron.
    Its step is the registry's `optimizer` slot (`--optimizer-impl`; `auto`: the first of the slot's
    `auto` order that can run here): megatron-core's as built, or the fused step of
    diffmeg.fusions.optimizer_step."""
    o, t = run.optim, run.training
    config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=t.params_dtype,
        use_distributed_optimizer=run.parallel.use_distributed_optimizer,
        overlap_param_gather=run.parallel.overlap_param_gather,  # Megatron-LM passes it on as well
        # megatron-core's gloo side groups would double the process groups on CPU; not needed here.
    )
    optimizer = get_megatron_optimizer(config, model, use_gloo_process_groups=False)
    registry.select("optimizer", run.impls["optimizer_impl"]).load()(optimizer)
    return optimizer


def build_scheduler(run: RunConfig, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Iteration-based schedule: warmup then `--lr-decay-style` down to `--min-lr` at `--lr-decay-iters`."""
    o = run.optim
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters,
        lr_decay_steps=o.lr_decay_iters,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=run.training.train_iters,
        wd_incr_style="constant",
        # Any difference from the checkpoint's schedule was refused before loading unless one of the two
        # flags settled it (CheckpointManager.check_schedule): "use the checkpoint's" is then exact.
        use_checkpoint_opt_param_scheduler=not o.override_opt_param_scheduler,
        override_opt_param_scheduler=o.override_opt_param_scheduler,
    )


def release_training_objects(config, model: list) -> None:
    """Undo what `build_training_objects` hooked up, so that dropping the model and optimizer frees them
    in a process that goes on (benchmarks and tools that build one run after another): the parameter
    gather pre-hooks (`remove_param_gather_hooks` says what they would keep alive) and the config's
    callbacks into the model chunks and the optimizer. The objects cannot train afterwards."""
    remove_param_gather_hooks(model)
    clear_schedule_hooks(config)
    config.finalize_model_grads_func = config.grad_scale_func = None
