"""Training state in checkpoints: what a run saves (model, optimizer, scheduler, RNG, counters) and how
it resumes exactly. Paths, the tracker, the writer and offline reading are `diffmeg.checkpoints`'.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from diffmeg.checkpoints import (
    TRACKER_FILE,
    WEIGHTS_ONLY_KEY,
    checkpoint_path,
    load_sharded,
    read_tracker,
    write_checkpoint,
)
from diffmeg.errors import DiffmegError

# megatron-core's distributed optimizer without TE/apex saves and reloads exactly in this format
# (same TP/PP; DP may change); the default `fully_sharded_model_space` fails without them.
DISTOPT_SHARDING = "dp_reshardable"


@dataclass
class LoadedState:
    iteration: int = 0
    consumed_samples: int = 0
    loaded: bool = False


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers down to the GPTModel."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _layout() -> dict[str, int]:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }


def _rng_object() -> ShardedObject:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    pp, tp = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    return ShardedObject(
        "rng_state",
        state,
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        (pp, tp),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def _prefill_distributed_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Allocate Adam state before loading a distributed-optimizer checkpoint into it.

    Without TE/apex, megatron-core's `DistributedOptimizer.state_dict()` needs per-param Adam state
    (it reads `step` from it), which exists only after a first step. One step with zero gradients and
    zero lr/weight decay allocates it without touching the parameters; loading then overwrites it.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or len(opt.optimizer.state) > 0:
            continue
        saved = [(g["lr"], g["weight_decay"]) for g in opt.optimizer.param_groups]
        for g in opt.optimizer.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        opt.optimizer.step()
        opt.optimizer.zero_grad()
        for g, (lr, wd) in zip(opt.optimizer.param_groups, saved, strict=True):
            g["lr"], g["weight_decay"] = lr, wd


def _restore_distributed_optimizer_step(optimizer: MegatronOptimizer) -> None:
    """Copy the loaded Adam step count into the pre-filled per-parameter state.

    megatron-core restores `step` into the param groups but keeps already-allocated per-parameter
    state (ours, from the pre-fill) whose `step` torch's Adam actually reads for bias correction.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for group in opt.optimizer.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = opt.optimizer.state.get(p)
                if state and "step" in state:
                    state["step"] = torch.tensor(
                        float(group["step"]), dtype=state["step"].dtype, device=state["step"].device
                    )


def _state_dict(
    model: torch.nn.Module,
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    *,
    is_loading: bool,
    with_rng: bool,
) -> dict:
    model_sd = unwrap_model(model).sharded_state_dict()
    state: dict = {"model": model_sd}
    if optimizer is not None:
        if is_loading:
            _prefill_distributed_optimizer_state(optimizer)
        metadata = {"distrib_optim_sharding_type": DISTOPT_SHARDING}
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_object()
    return state


def save_checkpoint(
    args: argparse.Namespace,
    iteration: int,
    consumed_samples: int,
    model: torch.nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
) -> str:
    """Write `iter_N` on all ranks, then mark it latest. Returns the checkpoint directory."""
    state = _state_dict(model, optimizer, scheduler, is_loading=False, with_rng=True)
    state.update(
        iteration=iteration,
        consumed_samples=consumed_samples,
        layout=_layout(),
        args=json.dumps(vars(args), default=str),
    )
    return write_checkpoint(args.save, iteration, state, args)


def load_checkpoint(
    args: argparse.Namespace,
    model: torch.nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
) -> LoadedState:
    """Restore from `args.load` (latest complete checkpoint). Returns where training resumes."""
    root = args.load
    if not os.path.isdir(root):
        raise DiffmegError(f"--load {root} does not exist")
    iteration = read_tracker(root)
    if iteration is None:
        if any(name.startswith("iter_") for name in os.listdir(root)):
            raise DiffmegError(
                f"{root} has checkpoint directories but no {TRACKER_FILE}: the last save did not finish; "
                f"write the iteration to resume from into {TRACKER_FILE}"
            )
        return LoadedState()  # an empty directory: start from scratch, as Megatron-LM does
    path = checkpoint_path(root, iteration)
    if not os.path.isdir(path):
        raise DiffmegError(f"{TRACKER_FILE} in {root} names iteration {iteration} but {path} is missing")

    common = dist_checkpointing.load_common_state_dict(path)
    saved_layout = common.get("layout", {})
    same_model_layout = (
        saved_layout.get("tp") == _layout()["tp"] and saved_layout.get("pp") == _layout()["pp"]
    )
    # A weights-only checkpoint (an HF import) has no optimizer/scheduler/RNG state to resume.
    weights_only = bool(common.get(WEIGHTS_ONLY_KEY))
    load_optim = not (args.no_load_optim or args.finetune or weights_only)
    if load_optim and args.use_distributed_optimizer and not same_model_layout:
        raise DiffmegError(
            f"distributed-optimizer state in {path} was saved at TP={saved_layout.get('tp')} "
            f"PP={saved_layout.get('pp')} and cannot be resharded to this layout; add --no-load-optim"
        )
    load_rng = not (args.no_load_rng or args.finetune or weights_only) and same_model_layout
    state = _state_dict(
        model,
        optimizer if load_optim else None,
        scheduler if load_optim else None,
        is_loading=True,
        with_rng=load_rng,
    )
    with torch.no_grad():  # the distributed optimizer copies into views of leaf parameters
        loaded = load_sharded(state, path)
        unwrap_model(model).load_state_dict(loaded["model"])
        if load_optim:
            if "optimizer" not in loaded:
                raise DiffmegError(f"{path} has no optimizer state; add --no-load-optim")
            optimizer.load_state_dict(loaded["optimizer"])
            _restore_distributed_optimizer_step(optimizer)
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_rng:
        from megatron.core import tensor_parallel

        rng = loaded["rng_state"]
        torch.set_rng_state(rng["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    if args.finetune or weights_only:
        return LoadedState(loaded=True)
    return LoadedState(
        iteration=int(common["iteration"]), consumed_samples=int(common["consumed_samples"]), loaded=True
    )


def load_pretrained_weights(root: str, model: torch.nn.Module) -> int:
    """Weights only (no optimizer, scheduler, RNG or counters) from `root`'s latest checkpoint.

    The checkpoint may have been trained at another sequence length, RoPE base, LR schedule or parallel
    layout: weights are layout-free and none of those change their shapes. Returns its iteration.
    """
    iteration = read_tracker(root) if os.path.isdir(root) else None
    if iteration is None:
        raise DiffmegError(f"--pretrained-checkpoint {root} holds no complete checkpoint ({TRACKER_FILE})")
    path = checkpoint_path(root, iteration)
    with torch.no_grad():
        loaded = load_sharded({"model": unwrap_model(model).sharded_state_dict()}, path)
        unwrap_model(model).load_state_dict(loaded["model"])
    return iteration
