"""From resolved arguments to the config, the wrapped model, optimizer and scheduler of a training run."""

from __future__ import annotations

import argparse

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module

from diffmeg.model import build_model, config_from_args
from diffmeg.training.grads import finalize_diff_model_grads
from diffmeg.training.optim import build_optimizer, build_scheduler
from diffmeg.training.run_config import RunConfig, as_run_config


def build_training_objects(run: RunConfig | argparse.Namespace):
    """(config, DDP model, optimizer, scheduler) for this rank; parallel state must be initialised.

    `run` may also be resolved flat arguments (the benchmarks hold those). The TransformerConfig comes from
    `config_from_args`, the one mapping of flags to megatron-core's config that the offline readers
    (conversion, single-rank models of checkpoints) share with training.
    """
    run = as_run_config(run)
    m, t, p = run.model, run.training, run.parallel
    config = config_from_args(run.to_args())
    model = build_model(
        config,
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_position_embeddings,
        rotary_base=m.rotary_base,
        use_te=m.transformer_impl == "transformer_engine",
        seed=t.seed,
    )
    if t.bf16 or t.fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=p.overlap_grad_reduce,
        use_distributed_optimizer=p.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = build_optimizer(run, [model])
    scheduler = build_scheduler(run, optimizer)
    config.finalize_model_grads_func = finalize_diff_model_grads
    config.no_sync_func = model.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return config, model, optimizer, scheduler
