"""The training loop: megatron-core's pipeline schedules, optimizer step, eval, checkpoints, logs."""

from __future__ import annotations

import argparse
import math
import os
import signal
import time

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from diffmeg import runtime
from diffmeg.compat import model_parallel_manual_seed
from diffmeg.errors import DiffmegError
from diffmeg.model import lambda_parameters
from diffmeg.training.arguments import args_to_json
from diffmeg.training.builders import build_training_objects
from diffmeg.training.checkpointing import (
    LoadedState,
    load_checkpoint,
    load_pretrained_weights,
    save_checkpoint,
    unwrap_model,
)
from diffmeg.training.data import build_datasets, microbatches
from diffmeg.training.distributed import initialize_distributed
from diffmeg.training.flops import train_flops_per_iteration
from diffmeg.training.logger import TrainingLogger


def _forward_step(data_iterator, model):
    """One micro-batch forward; returns the output and the loss function megatron-core's schedules call."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device)
    labels = batch["labels"].to(device)
    loss_mask = batch["loss_mask"].to(device).float()
    output = model(
        input_ids=tokens, position_ids=batch["position_ids"].to(device), attention_mask=None, labels=labels
    )

    def loss_func(per_token_loss: torch.Tensor):
        # Mean over the whole sequence. Under context parallelism this rank holds only some tokens:
        # divide its sum by the CP-global token count (megatron-core's schedule then multiplies by the
        # CP size and DDP averages over DP x CP, so the gradient is that of the global mean).
        local_sum = (per_token_loss.float() * loss_mask).sum()
        count = loss_mask.sum()
        cp_group = parallel_state.get_context_parallel_group()
        if cp_group.size() > 1:
            count = count.clone()
            torch.distributed.all_reduce(count, group=cp_group)
        loss = local_sum / count.clamp(min=1)
        reported = loss.detach().clone()  # clone: the schedule scales the returned loss in place
        if cp_group.size() > 1:
            torch.distributed.all_reduce(reported, group=cp_group)
        return loss, {"lm loss": reported}

    return output, loss_func


def _mean_loss(losses: list[dict]) -> torch.Tensor:
    """Mean over this rank's micro-batches, then over data- and context-parallel ranks (last stage only).

    Every CP rank holds the same number of tokens, so the mean of their means is the sequence mean.
    """
    value = torch.stack([d["lm loss"] for d in losses]).mean()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(value, group=group)
    return value / torch.distributed.get_world_size(group)


def _share_from_last_stage(value: float | None) -> float:
    """Make a last-stage scalar known to every rank (one small all-reduce)."""
    t = torch.tensor(
        [0.0 if value is None else value, 1.0 if value is not None else 0.0], dtype=torch.float64
    )
    if torch.cuda.is_available():
        t = t.cuda()
    torch.distributed.all_reduce(t)
    return (t[0] / t[1]).item()


def _run_step(model, optimizer, args, data_iter, forward_only: bool) -> float | None:
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=data_iter,
        model=[model],
        num_microbatches=args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )
    if parallel_state.is_pipeline_last_stage():
        return _mean_loss(losses).item()
    return None


def evaluate(model, optimizer, args, dataset, iteration: int) -> float:
    """Mean validation loss over `--eval-iters` global batches (deterministic: always the first ones)."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(args.eval_iters):
            it = microbatches(
                dataset, i * args.global_batch_size, args.global_batch_size, args.micro_batch_size
            )
            loss = _run_step(model, optimizer, args, it, forward_only=True)
            total += _share_from_last_stage(loss)
    model.train()
    return total / max(1, args.eval_iters)


class _SignalFlag:
    """Set by SIGTERM/SIGUSR1 (Slurm's pre-timeout signal): save a checkpoint and exit cleanly."""

    def __init__(self) -> None:
        self.received = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass

    def _handler(self, signum, frame) -> None:
        self.received = True

    def any_rank(self) -> bool:
        t = torch.tensor([1.0 if self.received else 0.0])
        torch.distributed.all_reduce(t)
        return bool(t.item() > 0)


def pretrain(args: argparse.Namespace) -> dict:
    """Train as `args` says. Returns a summary (final iteration, last loss) for callers and tests."""
    runtime.setup()
    rank, world = initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes)
    if (
        world
        != args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
        * args.data_parallel_size
    ):
        raise DiffmegError(f"world size {world} does not match the layout validated from WORLD_SIZE")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
    )
    model_parallel_manual_seed(args.seed)
    if rank == 0:
        print("------------------------ arguments ------------------------", flush=True)
        print(args_to_json(args), flush=True)
        print("-------------------- end of arguments ---------------------", flush=True)

    tokenizer = None
    if args.tokenizer_type == "null" and not args.mock_data:
        from diffmeg.data.tokenizer import IdTokenizer

        tokenizer = IdTokenizer(args.vocab_size)
    elif not args.mock_data:
        from diffmeg.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer_file)
        if tokenizer.vocab_size > args.vocab_size:
            raise DiffmegError(
                f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
            )

    rss_before_model = _rss_bytes("VmRSS")
    config, model, optimizer, scheduler = build_training_objects(args)
    state = LoadedState()
    if args.load is not None and (os.path.isdir(args.load) or args.pretrained_checkpoint is None):
        state = load_checkpoint(args, model, optimizer, scheduler)
        if rank == 0 and state.loaded:
            print(f" loaded checkpoint from {args.load} at iteration {state.iteration}", flush=True)
    if not state.loaded and args.pretrained_checkpoint is not None:
        source_iteration = load_pretrained_weights(args.pretrained_checkpoint, model)
        if rank == 0:
            print(
                f" initialised weights from pretrained checkpoint {args.pretrained_checkpoint} "
                f"(iteration {source_iteration}); optimizer, schedule and counters start fresh",
                flush=True,
            )
    train_ds, valid_ds, _ = build_datasets(args, tokenizer)

    is_logging_rank = rank == world - 1
    log = TrainingLogger(args.tensorboard_dir, args.metrics_file, enabled=is_logging_rank)
    flops_per_iter = train_flops_per_iteration(args)
    signals = _SignalFlag()
    iteration, consumed = state.iteration, state.consumed_samples
    last_loss = math.nan
    skipped = 0
    window_start, window_iters = time.perf_counter(), 0
    model.train()
    try:
        while iteration < args.train_iters:
            model.zero_grad_buffer()
            optimizer.zero_grad()
            data_iter = microbatches(train_ds, consumed, args.global_batch_size, args.micro_batch_size)
            loss = _run_step(model, optimizer, args, data_iter, forward_only=False)
            update_ok, grad_norm, _ = optimizer.step()
            iteration += 1
            consumed += args.global_batch_size
            if update_ok:
                scheduler.step(increment=1)
            else:
                skipped += 1
            last_loss = _share_from_last_stage(loss)
            if not math.isfinite(last_loss):
                raise DiffmegError(
                    f"lm loss is {last_loss} at iteration {iteration}; stopping (lower --lr, check the data, "
                    f"or resume from the last checkpoint)"
                )
            window_iters += 1
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                elapsed = (time.perf_counter() - window_start) / window_iters
                lambdas = {k: float(v) for k, v in lambda_parameters(unwrap_model(model)).items()}
                log.training(
                    iteration=iteration,
                    train_iters=args.train_iters,
                    consumed_samples=consumed,
                    elapsed_ms=elapsed * 1000,
                    tflops=flops_per_iter / elapsed / world / 1e12,
                    lr=optimizer.param_groups[0]["lr"],
                    global_batch_size=args.global_batch_size,
                    loss=last_loss,
                    grad_norm=grad_norm,
                    loss_scale=optimizer.get_loss_scale().item(),
                    lambdas=lambdas,
                    skipped=skipped,
                )
                window_start, window_iters = time.perf_counter(), 0
            if valid_ds is not None and args.eval_iters > 0 and iteration % args.eval_interval == 0:
                log.validation(iteration, evaluate(model, optimizer, args, valid_ds, iteration))
            stop = signals.any_rank() or (
                args.exit_interval is not None and iteration % args.exit_interval == 0
            )
            if args.save and (iteration % args.save_interval == 0 or iteration == args.train_iters or stop):
                path = save_checkpoint(args, iteration, consumed, model, optimizer, scheduler)
                if rank == 0:
                    print(f" saved checkpoint at iteration {iteration} to {path}", flush=True)
            if stop:
                if rank == 0:
                    print(f" exiting at iteration {iteration}", flush=True)
                break
    finally:
        log.close()
    memory = _memory_report(args, rss_before_model)
    if is_logging_rank:
        print(
            f" memory (MiB) | measured peak: {memory['measured_peak_mib']:.1f} | "
            f"estimated: {memory['estimated_mib']:.1f} | ({memory['what']})",
            flush=True,
        )
    return {"iteration": iteration, "consumed_samples": consumed, "lm_loss": last_loss, "memory": memory}


def _rss_bytes(field: str) -> int:
    """VmRSS / VmHWM (peak) of this process from /proc, in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _memory_report(args: argparse.Namespace, rss_before_model: int) -> dict:
    """Measured peak vs `diffmeg.training.memory` estimate (GPU: allocator peak; CPU: RSS growth)."""
    from diffmeg.training.memory import estimate_memory

    estimate = estimate_memory(args)
    if torch.cuda.is_available():
        measured, what = torch.cuda.max_memory_allocated(), "GPU max allocated"
    else:
        measured, what = _rss_bytes("VmHWM") - rss_before_model, "CPU peak RSS growth since model build"
    return {"measured_peak_mib": measured / 2**20, "estimated_mib": estimate.total / 2**20, "what": what}


shutdown = runtime.teardown
