"""megatron-core's optimizer (plain or distributed) and LR/WD scheduler, from the run configuration."""

from __future__ import annotations

import torch
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from diffmeg import registry
from diffmeg.run_config import RunConfig


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
