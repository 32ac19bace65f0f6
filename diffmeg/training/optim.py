"""megatron-core's optimizer (plain or distributed) and LR/WD scheduler, from parsed arguments."""

from __future__ import annotations

import argparse

import torch
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def build_optimizer(args: argparse.Namespace, model: list[torch.nn.Module]) -> MegatronOptimizer:
    """AdamW with fp32 main params; weight decay skips 1-D params (norms, lambda vectors) as in Megatron."""
    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
        # megatron-core's gloo side groups would double the process groups on CPU; not needed here.
    )
    return get_megatron_optimizer(config, model, use_gloo_process_groups=False)


def build_scheduler(args: argparse.Namespace, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Iteration-based schedule: warmup then `--lr-decay-style` down to `--min-lr` at `--lr-decay-iters`."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
