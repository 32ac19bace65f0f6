"""Data-parallel wrapping and its overlapped communication, wired as Megatron-LM wires megatron-core's.

- `--overlap-grad-reduce`: megatron-core's DDP splits the gradient buffer into buckets of
  `--ddp-bucket-size` parameters and starts each bucket's all-reduce (reduce-scatter with the distributed
  optimizer) from the backward hook of its last gradient, so communication runs under the rest of
  backward; `finalize_model_grads` only waits. The schedules keep the buckets quiet during the other
  micro-batches through `config.no_sync_func`.
- `--overlap-param-gather` (distributed optimizer only): the optimizer step updates this rank's shard and
  does not all-gather; a forward pre-hook on every module waits for its bucket's all-gather (started on
  first use) and starts the next bucket's, so the gather runs under the next forward.
- Interleaved pipelines (several model chunks per rank): one DDP per chunk; only the first chunk of the
  first pipeline rank is bucketed (elsewhere communication is off the critical path), and the schedule
  starts the chunks' grad reductions (`config.grad_sync_func`) and param gathers (`config.param_sync_func`,
  `align_param_gather`) at the same time on every pipeline rank.

While parameter gathers are overlapped, the weights between an optimizer step and the next forward are
only this rank's shard: anything that reads them outside a training forward (evaluation, a checkpoint, the
logged lambdas) first finishes the gathers (`finish_param_gather`) or turns the hooks off around it
(`params_gathered`), as Megatron-LM does around evaluation and saves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from diffmeg.errors import DiffmegError
from diffmeg.run_config import RunConfig


def ddp_config(run: RunConfig) -> DistributedDataParallelConfig:
    """megatron-core's DDP settings of a run (fp32 gradient buckets, Megatron-LM's flags)."""
    p = run.parallel
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        # Megatron-LM aligns the chunks' all-gathers over pipeline ranks only under the interleaved
        # schedule (its --align-param-gather default, turned off for one chunk per rank).
        align_param_gather=p.overlap_param_gather and p.model_chunks > 1,
        use_distributed_optimizer=p.use_distributed_optimizer,
        bucket_size=p.ddp_bucket_size,
    )


def wrap_model_chunks(
    config, ddp: DistributedDataParallelConfig, chunks: list[torch.nn.Module]
) -> list[DistributedDataParallel]:
    """One DDP per model chunk; chunks after the first get one bucket each (Megatron-LM's policy). Under
    `--gradient-accumulation-fusion` the fused linears add into the `main_grad` DDP gives their weights
    (`require_main_grad`)."""
    model = [
        DistributedDataParallel(config, ddp, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    if config.gradient_accumulation_fusion:
        require_main_grad(model)
    return model


def require_main_grad(modules: Iterable[torch.nn.Module]) -> None:
    """Refuse (one line) a model whose fused linears have no `main_grad` to accumulate into
    (`diffmeg.fusions.grad_accum`): megatron-core would fail deep in backward. megatron-core's DDP wrapper
    gives every trained parameter one; a model trained without it cannot use the fusion."""
    for module in modules:
        for name, layer in module.named_modules():
            weight = getattr(layer, "weight", None)
            fused = getattr(layer, "gradient_accumulation_fusion", False)
            if fused and isinstance(weight, torch.nn.Parameter) and weight.requires_grad:
                if not hasattr(weight, "main_grad"):
                    raise DiffmegError(
                        f"--gradient-accumulation-fusion adds weight gradients into megatron-core DDP's "
                        f"main_grad, which {name or 'the model'}.weight lacks: wrap the model in "
                        "megatron.core.distributed.DistributedDataParallel (as pretrain_diff.py does) or "
                        "turn the fusion off"
                    )


def clear_schedule_hooks(config) -> None:
    """No DDP hooks for the pipeline schedules on the model config (the config then holds no chunk)."""
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None


def set_schedule_hooks(config, model: list[DistributedDataParallel]) -> None:
    """The pipeline schedules' DDP hooks on the model config, as Megatron-LM's training.py sets them."""
    ddp = model[0].ddp_config
    clear_schedule_hooks(config)
    if ddp.overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in model]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
    if ddp.overlap_param_gather and ddp.align_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in model]
    if len(model) == 1:  # the non-interleaved schedules take one function, not a list
        for name in ("no_sync_func", "grad_sync_func", "param_sync_func"):
            if getattr(config, name) is not None:
                setattr(config, name, getattr(config, name)[0])


def param_gather_overlapped(model: list[DistributedDataParallel]) -> bool:
    """Does the model gather its parameters in forward pre-hooks (--overlap-param-gather)?"""
    return any(getattr(chunk, "use_forward_hook", False) for chunk in model)


def finish_param_gather(model: list[DistributedDataParallel]) -> None:
    """Complete every parameter all-gather the last optimizer step left to the next forward: waits for
    those in flight and runs the others now (each bucket's gather then counts as done, so the next
    forward's hooks do not repeat it). A no-op without --overlap-param-gather."""
    if param_gather_overlapped(model):
        for chunk in model:
            chunk.start_param_sync(force_sync=True)


def remove_param_gather_hooks(model: list[DistributedDataParallel]) -> None:
    """Finish the gathers in flight and remove the --overlap-param-gather forward pre-hooks for good (a
    run that is over). Each hook holds its DDP wrapper, and megatron-core's RotaryEmbedding caches its
    forward in a process-wide `lru_cache` keyed on the module, so a hooked rotary module would keep the
    model, its gradients and the optimizer state alive after the run. A no-op without the hooks."""
    if param_gather_overlapped(model):
        for chunk in model:
            chunk.disable_forward_pre_hook(param_sync=True)
            chunk.use_forward_hook = False


@contextlib.contextmanager
def params_gathered(model: list[DistributedDataParallel]) -> Iterator[None]:
    """Full weights and no param-gather pre-hooks inside (Megatron-LM's evaluation): the gathers are
    finished on entry, the hooks are back on exit."""
    if not param_gather_overlapped(model):
        yield
        return
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in model:
            chunk.enable_forward_pre_hook()


def bucket_count(model: list[DistributedDataParallel]) -> int:
    """Communication buckets per step on this rank (over all chunks and buffers)."""
    return sum(len(buffer.buckets) for chunk in model for buffer in chunk.buffers)


def describe(model: list[DistributedDataParallel]) -> str | None:
    """One line on this rank's overlapped data-parallel communication (None when nothing overlaps)."""
    ddp = model[0].ddp_config
    if not ddp.overlap_grad_reduce or model[0].dp_cp_group.size() == 1:
        return None
    grads = "reduce-scatter" if ddp.use_distributed_optimizer else "all-reduce"
    params = " and parameter all-gather" if ddp.overlap_param_gather else ""
    size = f"{model[0].bucket_size:,} parameters" if model[0].bucket_size else "one bucket"
    later = "; later model chunks one bucket each" if len(model) > 1 else ""
    return (
        f" overlapped data-parallel communication: gradient {grads}{params} in {bucket_count(model)} "
        f"buckets per step on rank 0 (bucket size {size}{later})"
    )
