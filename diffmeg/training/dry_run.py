"""`pretrain_diff.py --dry-run`: the resolved run as JSON, and the checks a user wants before queueing.

Besides the configuration, a dry run checks what would stop or doom the real run, one line each:
- data: every `--data-path` dataset must have its `.bin` and `.idx` (all missing ones named in one error),
  hold ids of the run's tokenizer (its `.tokenizer.json` record, diffmeg.data.tokenizers) and pass the run's
  own blend and `--split` checks (`check_blend`); the folder of its index cache is resolved as the run
  resolves it (diffmeg.data.index_cache: an unwritable `--data-cache-path` is refused the same way);
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
import sys
from dataclasses import asdict

from diffmeg.config import count_parameters
from diffmeg.data.gpt_datasets import BUILTIN, check_blend, parse_data_path
from diffmeg.data.index_cache import resolve_cache_path
from diffmeg.data.indexed import check_dataset, has_loss_mask
from diffmeg.data.tokenizers import check_datasets, check_vocabulary, record_of_args
from diffmeg.errors import DiffmegError
from diffmeg.run_config import DataConfig, RunConfig
from diffmeg.training.flops import train_flops_per_iteration
from diffmeg.training.memory import GIB, estimate_memory, loss_peak_bytes, shrink_options

HEADROOM = 0.9
"""Plans above this fraction of the GPU's memory get a warning: the rest is not ours to plan."""


def dry_run_summary(run: RunConfig) -> dict:
    """The fully resolved run, as a user checks it before queueing."""
    model, parallel, training, optim = run.model, run.parallel, run.training, run.optim
    tokens_per_batch = run.tokens_per_step
    v1 = model.diff_attention and model.diff_version == 1
    architecture = ("diff" if v1 else "diff2") if model.diff_attention else "transformer"
    if model.diff_attention and model.num_noise_heads not in (None, model.num_attention_heads):
        architecture = "gda-v1" if v1 else "gda"  # grouped: fewer noise heads than signal heads
    return {
        "model": {
            "preset": model.preset,
            "architecture": architecture,
            "num_layers": model.num_layers,
            "hidden_size": model.hidden_size,
            "ffn_hidden_size": model.ffn_hidden_size,
            "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.num_query_groups,
            "num_noise_heads": model.num_noise_heads if model.diff_attention else None,
            "mlp_activation": model.mlp_activation,
            "head_dim": model.kv_channels,
            "value_head_dim": 2 * model.kv_channels if v1 else model.kv_channels,
            "seq_length": model.seq_length,
            "vocab_size": model.vocab_size,
            "rotary_base": model.rotary_base,
            "lambda_init": model.lambda_init if v1 else None,
            "tie_embeddings_and_output_weights": model.tie_embeddings_and_output_weights,
            "transformer_impl": model.transformer_impl,
        },
        "parallel": {
            "world_size": parallel.world_size,
            "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
            "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
            "context_parallel_size": parallel.context_parallel_size,
            "cp_comm_type": parallel.cp_comm_type if parallel.context_parallel_size > 1 else None,
            "data_parallel_size": parallel.data_parallel_size,
            "sequence_parallel": parallel.sequence_parallel,
            "use_distributed_optimizer": parallel.use_distributed_optimizer,
            "virtual_pipeline_model_parallel_size": parallel.virtual_pipeline_model_parallel_size,
        },
        "batch": {
            "micro_batch_size": training.micro_batch_size,
            "global_batch_size": training.global_batch_size,
            "tokens_per_batch": tokens_per_batch,
            "num_microbatches": run.num_microbatches,
        },
        "schedule": {
            "train_iters": training.train_iters,
            "total_tokens": training.train_iters * tokens_per_batch,
            "lr": optim.lr,
            "min_lr": optim.min_lr,
            "lr_warmup_iters": optim.lr_warmup_iters,
            "lr_decay_iters": optim.lr_decay_iters,
            "lr_decay_style": optim.lr_decay_style,
            "optimizer": "adamw",
            "adam_beta1": optim.adam_beta1,
            "adam_beta2": optim.adam_beta2,
            "adam_eps": optim.adam_eps,
            "weight_decay": optim.weight_decay,
            "clip_grad": optim.clip_grad,
            "precision": training.precision,
            "fp8_format": training.fp8_format,
        },
        "num_parameters": count_parameters(run.model),
        "flops_per_step": train_flops_per_iteration(run),
        "memory_per_gpu_gib": estimate_memory(run, on_gpu=True).as_gib(),
        "features": features(run),
        "data": {
            "data_path": run.data.data_path,
            "mock_data": run.data.mock_data,
            "split": run.data.split,
            "tokenizer_type": run.data.tokenizer_type,
            "tokenizer_model": run.data.tokenizer_model,
        },
        "checkpointing": {
            "save": run.checkpoint.save,
            "load": run.checkpoint.load,
            "save_interval": run.checkpoint.save_interval,
            "async_save": run.checkpoint.async_save and run.checkpoint.save is not None,
            "pretrained_checkpoint": run.checkpoint.pretrained_checkpoint,
        },
    }


def chunked_loss_feature(run: RunConfig) -> str:
    """`--cross-entropy-chunk-size` and what it buys: the loss's planned peak (GiB per GPU, one micro-batch
    on the last stage) over chunks against the whole logits."""
    chunk = run.training.cross_entropy_chunk_size
    whole = loss_peak_bytes(run, None) / GIB
    if not chunk:
        return f"off: the whole logits, {whole:.3f} GiB at the loss's peak (--cross-entropy-chunk-size)"
    return (
        f"on: the loss peaks at {loss_peak_bytes(run, chunk) / GIB:.3f} GiB over chunks of {chunk} tokens "
        f"instead of {whole:.3f} GiB over the whole logits"
    )


def pipeline_bubble(run: RunConfig, chunks: int | None = None) -> float:
    """Idle time over compute time of a 1F1B step, (PP - 1) / micro-batches / model chunks (Megatron-LM's
    paper); `chunks` None: the run's virtual pipeline stages."""
    chunks = chunks or run.parallel.model_chunks
    return (run.parallel.pipeline_model_parallel_size - 1) / run.num_microbatches / chunks


def features(run: RunConfig) -> dict[str, str]:
    """The throughput features a run can use, one line each: "on: what it buys" or "off: why"."""
    parallel = run.parallel
    replicas = parallel.data_parallel_size * parallel.context_parallel_size  # DDP reduces over DP x CP
    chunks = parallel.model_chunks
    params = count_parameters(  # the largest pipeline stage's, on one tensor-parallel rank
        run.model, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    )
    if replicas == 1:
        grads = params_ = "off: DP x CP = 1, nothing to communicate"
    else:
        grads = "off: gradients are reduced after backward (--overlap-grad-reduce)"
        if parallel.overlap_grad_reduce:
            bucket = parallel.ddp_bucket_size or max(40_000_000, 1_000_000 * replicas)
            buckets = -(-params // chunks // bucket) + chunks - 1  # chunks after the first: one bucket
            reduce = "reduce-scatter" if parallel.use_distributed_optimizer else "all-reduce"
            grads = (
                f"on: the {params * 4 / 2**30:.1f} GiB fp32 gradient {reduce} runs under backward in "
                f"~{buckets} buckets of {bucket:,} parameters, not after it"
            )
        params_ = "off: without the distributed optimizer nothing is all-gathered"
        if parallel.overlap_param_gather:
            weight_bytes = 4 if run.training.precision == "fp32" else 2
            params_ = (
                f"on: the {params * weight_bytes / 2**30:.1f} GiB all-gather of updated weights runs under "
                "the next forward, not after the optimizer step"
            )
        elif parallel.use_distributed_optimizer:
            params_ = "off: weights are all-gathered after the optimizer step (--overlap-param-gather)"
    pp = parallel.pipeline_model_parallel_size
    bubble = pipeline_bubble(run, chunks=1)
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
        "chunked_cross_entropy": chunked_loss_feature(run),
        "async_save": async_save_feature(run),
    }


def async_save_feature(run: RunConfig) -> str:
    """`--async-save`: whether a checkpoint save stalls training for the whole write."""
    if run.checkpoint.save is None:
        return "off: nothing is saved (--save)"
    if run.checkpoint.async_save:
        return (
            "on: a writer process per rank writes each checkpoint from a host snapshot while training "
            "continues; the tracker names it once every rank's files are complete"
        )
    return "off: every save stalls training until all its files are written (--async-save)"


def memory_warnings(run: RunConfig, limit: float, total_gib: float) -> list[str]:
    """A warning when the per-GPU plan does not fit `--gpu-memory-gib` (`limit`, > 0: its range) with 10% to
    spare."""
    if total_gib <= HEADROOM * limit:
        return []
    fixes = shrink_options(run)
    world = run.parallel.world_size
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


def check_data(data: DataConfig) -> dict[str, int]:
    """Tokens per `--data-path` dataset; every missing `.bin`/`.idx` in one error, then the weights."""
    if data.mock_data:
        return {}
    if len(data.data_path) != 1 and len(data.data_path) % 2:
        parse_data_path(data.data_path)  # its one-line error for a malformed blend
    prefixes = [p for p in data_prefixes(data.data_path) if p != BUILTIN]
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
    parse_data_path(data.data_path)  # the blend weights
    return found


def check_split(data: DataConfig) -> dict[str, list[int | None]]:
    """The run's own blend and ``--split`` checks (`check_blend`: the same function, so the same refusal in
    the same line); each dataset's documents per split (train, valid, test; None for a weight of 0)."""
    if data.mock_data:
        return {}
    return check_blend(parse_data_path(data.data_path)[0], data.split)


def check_cache(data: DataConfig) -> tuple[str | None, str | None]:
    """(the folder the run would cache its dataset indices in, the line it would print about it): the run's
    own `resolve_cache_path`, so an unwritable ``--data-cache-path`` is refused here in the same line. None
    where the run caches nothing (mock or loss-masked data) or the folder is only known once the builtin
    corpus is built."""
    if data.mock_data:
        return None, None
    prefixes = parse_data_path(data.data_path)[0]
    if any(has_loss_mask(p) for p in prefixes) or (prefixes[0] == BUILTIN and not data.data_cache_path):
        return None, None
    return resolve_cache_path(prefixes, data.data_cache_path)


def dataset_tokens(prefix: str) -> int:
    """Tokens in a dataset, after the cheap checks that its `.idx` and `.bin` agree (header, sizes, the end
    of its last sequence: a truncated copy is named here, not in a crash during training)."""
    try:
        return check_dataset(prefix)
    except DiffmegError as exc:
        raise DiffmegError(f"--data-path {prefix}: {exc}") from None


def dry_run(args: argparse.Namespace) -> int:
    """Print the resolved run (stdout) and its checks (stderr); exit status 0, or an error raised."""
    run = RunConfig.from_args(args)
    tokens = check_data(run.data)
    split_documents = check_split(run.data)
    check_datasets(list(tokens), record_of_args(asdict(run.data)))  # ids of the run's tokenizer (records)
    check_vocabulary(list(tokens), run.model.vocab_size)  # every id has an embedding row
    cache, cache_note = check_cache(run.data)
    summary = dry_run_summary(run)
    warnings = memory_warnings(run, args.gpu_memory_gib, summary["memory_per_gpu_gib"]["total"])
    summary["checks"] = {
        "gpu_memory_gib": args.gpu_memory_gib,
        "memory_fits": not warnings,
        "dataset_tokens": tokens,
        "split_documents": split_documents,
        "data_cache_path": cache,
        "notes": list(args.dropped_flags),
        "warnings": warnings,
    }
    print(json.dumps(summary, indent=2), flush=True)
    if tokens:
        total = sum(tokens.values())
        print(f"data: {len(tokens)} dataset(s) found, {total:,} tokens", file=sys.stderr)
    if cache_note:
        print(cache_note, file=sys.stderr)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    return 0
