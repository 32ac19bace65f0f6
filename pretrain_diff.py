"""Pretrain a Differential Transformer (or its FLOP-matched Transformer baseline) on megatron-core.

python pretrain_diff.py --model diff-tiny                       # CPU, embedded corpus
torchrun --nproc_per_node 8 pretrain_diff.py --model diff-3b --data-path ... --bf16
python pretrain_diff.py --model diff-3b --dry-run               # resolved config as JSON
"""

from __future__ import annotations

import json
import sys

from diffmeg.errors import cli_errors
from diffmeg.training.arguments import resolve_args


def dry_run_summary(args) -> dict:
    """The fully resolved run, as a user checks it before queueing."""
    from diffmeg.presets import count_parameters
    from diffmeg.training.flops import train_flops_per_iteration
    from diffmeg.training.memory import estimate_memory

    tokens_per_batch = args.global_batch_size * args.seq_length
    return {
        "model": {
            "preset": args.model,
            "architecture": "diff" if args.diff_attention else "transformer",
            "num_layers": args.num_layers,
            "hidden_size": args.hidden_size,
            "ffn_hidden_size": args.ffn_hidden_size,
            "num_attention_heads": args.num_attention_heads,
            "num_query_groups": args.num_query_groups,
            "head_dim": args.kv_channels,
            "value_head_dim": 2 * args.kv_channels if args.diff_attention else args.kv_channels,
            "seq_length": args.seq_length,
            "vocab_size": args.vocab_size,
            "rotary_base": args.rotary_base,
            "lambda_init": args.lambda_init if args.diff_attention else None,
            "transformer_impl": args.transformer_impl,
        },
        "parallel": {
            "world_size": args.data_parallel_size
            * args.tensor_model_parallel_size
            * args.pipeline_model_parallel_size
            * args.context_parallel_size,
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
            "context_parallel_size": args.context_parallel_size,
            "cp_comm_type": args.cp_comm_type if args.context_parallel_size > 1 else None,
            "data_parallel_size": args.data_parallel_size,
            "sequence_parallel": args.sequence_parallel,
            "use_distributed_optimizer": args.use_distributed_optimizer,
        },
        "batch": {
            "micro_batch_size": args.micro_batch_size,
            "global_batch_size": args.global_batch_size,
            "tokens_per_batch": tokens_per_batch,
            "num_microbatches": args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
        },
        "schedule": {
            "train_iters": args.train_iters,
            "total_tokens": args.train_iters * tokens_per_batch,
            "lr": args.lr,
            "min_lr": args.min_lr,
            "lr_warmup_iters": args.lr_warmup_iters,
            "lr_decay_iters": args.lr_decay_iters,
            "lr_decay_style": args.lr_decay_style,
            "optimizer": "adamw",
            "adam_beta1": args.adam_beta1,
            "adam_beta2": args.adam_beta2,
            "adam_eps": args.adam_eps,
            "weight_decay": args.weight_decay,
            "clip_grad": args.clip_grad,
            "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "fp8_format": args.fp8_format,
        },
        "num_parameters": count_parameters(
            args.num_layers,
            args.hidden_size,
            args.ffn_hidden_size,
            args.vocab_size,
            args.num_attention_heads,
            args.kv_channels,
            args.num_query_groups,
            diff_attention=args.diff_attention,
        ),
        "flops_per_step": train_flops_per_iteration(args),
        "memory_per_gpu_gib": estimate_memory(args, on_gpu=True).as_gib(),
        "data": {"data_path": args.data_path, "mock_data": args.mock_data, "split": args.split},
        "checkpointing": {"save": args.save, "load": args.load, "save_interval": args.save_interval},
    }


@cli_errors
def main(argv: list[str] | None = None) -> int:
    """Arguments -> runtime setup -> Trainer. Exit status 0, 2 (one-line error) or 130 (Ctrl-C)."""
    args = resolve_args(argv)
    if args.dry_run:
        print(json.dumps(dry_run_summary(args), indent=2))
        return 0
    from diffmeg import runtime
    from diffmeg.training.run_config import RunConfig
    from diffmeg.training.trainer import Trainer

    runtime.setup()
    try:
        # Inside train() Ctrl-C saves and stops (a second one exits at once); before it, this catches it.
        return Trainer(RunConfig.from_args(args)).train()["exit_code"]
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C) before training started", file=sys.stderr, flush=True)
        return 130
    finally:
        runtime.teardown()


if __name__ == "__main__":  # the dist-checkpoint writer uses a spawn context: this guard is required
    sys.exit(main())
