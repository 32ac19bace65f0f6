"""From resolved arguments to the config, the wrapped model, optimizer and scheduler."""

from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module

from diffmeg.config import DiffTransformerConfig, megatron_head_counts
from diffmeg.model import build_model
from diffmeg.training.grads import finalize_diff_model_grads
from diffmeg.training.optim import build_optimizer, build_scheduler, params_dtype
from diffmeg.training.run_config import RunConfig, as_run_config

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


def config_from_args(args: argparse.Namespace) -> DiffTransformerConfig:
    """The LLaMA macro layout (pre-RMSNorm, SwiGLU, no biases) with the run's sizes and parallelism."""
    on_gpu = torch.cuda.is_available()
    diff_version = getattr(args, "diff_version", 1)  # absent from args saved before DIFF V2 existed
    heads, groups = megatron_head_counts(
        args.num_attention_heads, args.num_query_groups, args.diff_attention, diff_version
    )
    dtype = params_dtype(args)
    return DiffTransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=args.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=getattr(args, "cp_comm_type", None),  # None in args saved before the flag existed
        sequence_parallel=args.sequence_parallel,
        deterministic_mode=getattr(args, "deterministic_mode", False),  # absent from older saved args
        use_cpu_initialization=not on_gpu,
        # megatron-core sets the TP attributes inside its init; diffmeg.init then redraws every parameter
        # layout-independently.
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        fp8=args.fp8_format,
        fp8_recipe=args.fp8_recipe,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        masked_softmax_fusion=fused_softmax_available(),
        bias_activation_fusion=on_gpu,
        apply_rope_fusion=False,
        diff_attention=args.diff_attention,
        diff_version=diff_version,
        lambda_init=args.lambda_init,
        lambda_std=args.lambda_std,
        attention_backend_diff=args.diff_attn_backend,
    )


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
