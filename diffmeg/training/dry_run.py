"""`pretrain_diff.py --dry-run`: the resolved run as JSON, and the checks a user wants before queueing.

Besides the configuration, a dry run checks what would stop or doom the real run, one line each:
- data: every `--data-path` dataset must have its `.bin` and `.idx` (all missing ones named in one error)
  and hold ids of the run's tokenizer (its `.tokenizer.json` record, diffmeg.data.tokenizers);
- memory: the per-GPU plan (training/memory.py) against `--gpu-memory-gib` (default 80, an H100): a plan
  over it, or within 10% of it (the CUDA context, NCCL buffers and allocator fragmentation live there),
  gets a `warning:` line saying which settings shrink it. A warning, not an error: the plan is an
  estimate, and a dry run outside a launcher sees one GPU where the real run may have many;
- flags the resolved run ignores were already printed as `note:` lines by `resolve_args`.
The JSON goes to stdout; warnings and notes go to stderr and into the JSON's `checks`. Its `features`
say which throughput features the run uses and what each buys (or why one is off).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

from diffmeg.errors import DiffmegError

HEADROOM = 0.9
"""Plans above this fraction of the GPU's memory get a warning: the rest is not ours to plan."""

CHUNK_HINT = 2048
"""The chunked loss's chunk size a memory warning proposes (the 64K recipe's)."""


def dry_run_summary(args: argparse.Namespace) -> dict:
    """The fully resolved run, as a user checks it before queueing."""
    from diffmeg.presets import count_parameters
    from diffmeg.training.flops import train_flops_per_iteration
    from diffmeg.training.memory import estimate_memory

    tokens_per_batch = args.global_batch_size * args.seq_length
    version = diff_version(args)
    v1 = args.diff_attention and version == 1
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)  # None: one model chunk per rank
    return {
        "model": {
            "preset": args.model,
            "architecture": ("diff" if v1 else "diff2") if args.diff_attention else "transformer",
            "num_layers": args.num_layers,
            "hidden_size": args.hidden_size,
            "ffn_hidden_size": args.ffn_hidden_size,
            "num_attention_heads": args.num_attention_heads,
            "num_query_groups": args.num_query_groups,
            "head_dim": args.kv_channels,
            "value_head_dim": 2 * args.kv_channels if v1 else args.kv_channels,
            "seq_length": args.seq_length,
            "vocab_size": args.vocab_size,
            "rotary_base": args.rotary_base,
            "lambda_init": args.lambda_init if v1 else None,
            "tie_embeddings_and_output_weights": tied(args),
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
            "virtual_pipeline_model_parallel_size": vp,
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
            "precision": precision(args),
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
            untie_embeddings=not tied(args),
            diff_version=version,
        ),
        "flops_per_step": train_flops_per_iteration(args),
        "memory_per_gpu_gib": estimate_memory(args, on_gpu=True).as_gib(),
        "features": features(args),
        "data": {
            "data_path": args.data_path,
            "mock_data": args.mock_data,
            "split": args.split,
            "tokenizer_type": args.tokenizer_type,
            "tokenizer_model": getattr(args, "tokenizer_model", None),
        },
        "checkpointing": {
            "save": args.save,
            "load": args.load,
            "save_interval": args.save_interval,
            "async_save": args.async_save and args.save is not None,
            "pretrained_checkpoint": args.pretrained_checkpoint,
        },
    }


def tied(args: argparse.Namespace) -> bool:
    """The output layer is the word embedding (args.json files without the flag: untied)."""
    return bool(getattr(args, "tie_embeddings_and_output_weights", False))


def chunked_loss_feature(args: argparse.Namespace) -> str:
    """`--cross-entropy-chunk-size` and what it buys: the loss's planned peak (GiB per GPU, one micro-batch
    on the last stage) over chunks against the whole logits."""
    from diffmeg.training.memory import GIB, loss_peak_bytes

    chunk = getattr(args, "cross_entropy_chunk_size", None)
    whole = loss_peak_bytes(args, None) / GIB
    if not chunk:
        return f"off: the whole logits, {whole:.3f} GiB at the loss's peak (--cross-entropy-chunk-size)"
    return (
        f"on: the loss peaks at {loss_peak_bytes(args, chunk) / GIB:.3f} GiB over chunks of {chunk} tokens "
        f"instead of {whole:.3f} GiB over the whole logits"
    )


def pipeline_bubble(args: argparse.Namespace, chunks: int | None = None) -> float:
    """Idle time over compute time of a 1F1B step, (PP - 1) / micro-batches / model chunks (Megatron-LM's
    paper); `chunks` None: the run's virtual pipeline stages."""
    chunks = chunks or getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    micro = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    return (args.pipeline_model_parallel_size - 1) / micro / chunks


def features(args: argparse.Namespace) -> dict[str, str]:
    """The throughput features a run can use, one line each: "on: what it buys" or "off: why"."""
    from diffmeg.training.memory import parameters_per_rank

    replicas = args.data_parallel_size * args.context_parallel_size  # DDP reduces over DP x CP
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    params = parameters_per_rank(args)
    if replicas == 1:
        grads = params_ = "off: DP x CP = 1, nothing to communicate"
    else:
        grads = "off: gradients are reduced after backward (--overlap-grad-reduce)"
        if getattr(args, "overlap_grad_reduce", False):
            bucket = getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * replicas)
            buckets = -(-params // chunks // bucket) + chunks - 1  # chunks after the first: one bucket
            reduce = "reduce-scatter" if args.use_distributed_optimizer else "all-reduce"
            grads = (
                f"on: the {params * 4 / 2**30:.1f} GiB fp32 gradient {reduce} runs under backward in "
                f"~{buckets} buckets of {bucket:,} parameters, not after it"
            )
        params_ = "off: without the distributed optimizer nothing is all-gathered"
        if getattr(args, "overlap_param_gather", False):
            weight_bytes = 4 if precision(args) == "fp32" else 2
            params_ = (
                f"on: the {params * weight_bytes / 2**30:.1f} GiB all-gather of updated weights runs under "
                "the next forward, not after the optimizer step"
            )
        elif args.use_distributed_optimizer:
            params_ = "off: weights are all-gathered after the optimizer step (--overlap-param-gather)"
    pp = args.pipeline_model_parallel_size
    bubble = pipeline_bubble(args, chunks=1)
    if pp == 1:
        pipeline = "off: no pipeline (PP 1)"
    elif chunks == 1:
        pipeline = (
            f"off: pipeline bubble (PP - 1) / micro-batches = {bubble:.3f} of a step; "
            "--num-layers-per-virtual-pipeline-stage divides it by the model chunks per rank"
        )
    else:
        pipeline = (
            f"on: {chunks} model chunks per rank: pipeline bubble {bubble / chunks:.3f} of a step instead "
            f"of {bubble:.3f}, for {chunks}x the pipeline's point-to-point traffic"
        )
    return {
        "overlap_grad_reduce": grads,
        "overlap_param_gather": params_,
        "interleaved_pipeline": pipeline,
        "chunked_cross_entropy": chunked_loss_feature(args),
        "async_save": async_save_feature(args),
    }


def async_save_feature(args: argparse.Namespace) -> str:
    """`--async-save`: whether a checkpoint save stalls training for the whole write."""
    if args.save is None:
        return "off: nothing is saved (--save)"
    if args.async_save:
        return (
            "on: a writer process per rank writes each checkpoint from a host snapshot while training "
            "continues; the tracker names it once every rank's files are complete"
        )
    return "off: every save stalls training until all its files are written (--async-save)"


def diff_version(args: argparse.Namespace) -> int:
    """1 unless set: arguments resolved before DIFF V2 existed (old checkpoints' args.json) mean V1."""
    return getattr(args, "diff_version", 1)


def precision(args: argparse.Namespace) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def memory_warnings(args: argparse.Namespace, total_gib: float) -> list[str]:
    """A warning when the per-GPU plan does not fit `--gpu-memory-gib` with 10% to spare."""
    limit = args.gpu_memory_gib
    if limit <= 0:
        raise DiffmegError(f"--gpu-memory-gib must be > 0, got {limit:g}")
    if total_gib <= HEADROOM * limit:
        return []
    fixes = []  # (flag, the Slurm recipes' knob)
    if precision(args) == "fp32":
        fixes.append(("--bf16", "PRECISION=bf16"))
    if not args.use_distributed_optimizer and args.data_parallel_size * args.context_parallel_size > 1:
        fixes.append(("--use-distributed-optimizer", "DIST_OPTIMIZER=1"))
    if args.recompute_granularity != "full":
        fixes.append(("--recompute-granularity full", "RECOMPUTE=full"))
    tokens = args.micro_batch_size * args.seq_length // args.context_parallel_size
    if not getattr(args, "cross_entropy_chunk_size", None) and tokens > CHUNK_HINT:
        fixes.append((f"--cross-entropy-chunk-size {CHUNK_HINT}", f"CE_CHUNK_SIZE={CHUNK_HINT}"))
    fixes.append(("more tensor/pipeline-parallel ranks", "TP, PP"))
    world = (
        args.data_parallel_size
        * args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    where = "exceeds" if total_gib > limit else f"leaves less than {100 * (1 - HEADROOM):.0f}% of"
    message = (
        f"the memory plan needs {total_gib:.1f} GiB per GPU, which {where} --gpu-memory-gib {limit:g} "
        f"({world} GPU{'s' if world > 1 else ''}); expect out-of-memory. To shrink it: "
        + ", ".join(flag for flag, _ in fixes)
        + " (Slurm recipes: "
        + ", ".join(knob for _, knob in fixes)
        + ")"
    )
    if world == 1 and "WORLD_SIZE" not in os.environ:
        message += "; this dry run sees 1 GPU: set WORLD_SIZE to the run's GPU count for its real layout"
    return [message]


def data_prefixes(data_path: list[str]) -> list[str]:
    """The dataset prefixes of a `--data-path` (one prefix, or `w1 p1 w2 p2 ...`)."""
    return list(data_path) if len(data_path) == 1 else list(data_path[1::2])


def check_data(args: argparse.Namespace) -> dict[str, int]:
    """Tokens per `--data-path` dataset; every missing `.bin`/`.idx` in one error."""
    from diffmeg.data.gpt_datasets import BUILTIN, parse_data_path

    if args.mock_data:
        return {}
    if len(args.data_path) != 1 and len(args.data_path) % 2:
        parse_data_path(args.data_path)  # its one-line error for a malformed blend
    prefixes = [p for p in data_prefixes(args.data_path) if p != BUILTIN]
    missing, found = [], {}
    for prefix in prefixes:
        absent = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if absent:
            hint = ""
            if prefix.endswith((".bin", ".idx")):
                hint = ", give the prefix without the extension"
            elif os.path.isfile(prefix + "_text_document.idx"):
                hint = f", did you mean {prefix}_text_document?"
            missing.append(f"{prefix} (no {' or '.join(absent)}{hint})")
        else:
            found[prefix] = dataset_tokens(prefix)
    if missing:
        raise DiffmegError(
            f"--data-path: {len(missing)} of {len(prefixes)} dataset(s) not found: {'; '.join(missing)}. "
            "A dataset is the prefix of a .bin/.idx pair written by tools/preprocess_data.py"
        )
    parse_data_path(args.data_path)  # the blend weights
    from diffmeg.data.tokenizers import check_datasets, record_of_args

    check_datasets(list(found), record_of_args(args))  # ids of this run's tokenizer (their records)
    return found


def dataset_tokens(prefix: str) -> int:
    """Tokens in a dataset, from the `.bin` size and the token width in the `.idx` header (cheap for any
    size: the index itself is not read)."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    with open(prefix + ".idx", "rb") as f:
        header = f.read(len(_INDEX_HEADER) + 9)
    if not header.startswith(_INDEX_HEADER) or len(header) < len(_INDEX_HEADER) + 9:
        raise DiffmegError(f"--data-path {prefix}: {prefix}.idx is not a megatron-core index")
    (code,) = struct.unpack("<B", header[len(_INDEX_HEADER) + 8 :])
    return os.path.getsize(prefix + ".bin") // DType.size(code)


def dry_run(args: argparse.Namespace) -> int:
    """Print the resolved run (stdout) and its checks (stderr); exit status 0, or an error raised."""
    tokens = check_data(args)
    summary = dry_run_summary(args)
    warnings = memory_warnings(args, summary["memory_per_gpu_gib"]["total"])
    summary["checks"] = {
        "gpu_memory_gib": args.gpu_memory_gib,
        "memory_fits": not warnings,
        "dataset_tokens": tokens,
        "notes": list(args.dropped_flags),
        "warnings": warnings,
    }
    print(json.dumps(summary, indent=2), flush=True)
    if tokens:
        total = sum(tokens.values())
        print(f"data: {len(tokens)} dataset(s) found, {total:,} tokens", file=sys.stderr)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    return 0
