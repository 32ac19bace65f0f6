"""Training state in checkpoints: what a run saves (model, optimizer, scheduler, RNG, counters), where
it resumes from, and how it resumes exactly. `CheckpointManager` is the Trainer's component for all of it
(torchtitan's idiom); paths, the tracker, the writer and offline reading are `diffmeg.checkpoints`'.

Where a run starts (Megatron-LM's rules, plus clear errors):
- `--load D` with a tracker: its iteration, or `--ckpt-step N` (any complete iteration of D);
- `--load D` holding no checkpoint yet (missing, empty, or the `--save` directory): from scratch, said in
  one line, so `--save D --load D` works on the first start of a requeue-friendly job;
- `--load` that is a file, a directory holding something else, or a missing path that is not the --save
  directory (a typo): one-line errors.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from diffmeg import collectives
from diffmeg.checkpoints import (
    TRACKER_FILE,
    WEIGHTS_ONLY_KEY,
    StartPoint,
    abandon_save,
    begin_checkpoint,
    checkpoint_path,
    holds_only_run_files,
    holds_saves,
    leftovers,
    load_sharded,
    not_a_checkpoint_message,
    read_start_point,
    read_tracker,
    resolve_iteration,
)
from diffmeg.compat.checkpoint_writer import AsyncSaves, HoldAfterWrite, run_now
from diffmeg.data.tokenizers import check_checkpoint, record_of_args
from diffmeg.errors import DiffmegError
from diffmeg.folder_lock import FolderLock
from diffmeg.run_config import SHAPE_FIELDS, ModelConfig, RunConfig
from diffmeg.storage import directory_bytes, format_bytes, free_bytes

STALL_ASYNC_SAVE_ENV = "DIFFMEG_TEST_STALL_ASYNC_SAVE"
"""Test hook, never for real runs: "N" or "N:PATH". With --async-save, rank 0's background writer of
iteration N's checkpoint stops once its files are written, before it reports them (until PATH exists, else
until it is killed), so a test can signal or kill a job at a known point while that save is in flight."""

# megatron-core's distributed optimizer without TE/apex saves and reloads exactly in this format
# (same TP/PP; DP may change); the default `fully_sharded_model_space` fails without them.
DISTOPT_SHARDING = "dp_reshardable"


@dataclass
class PendingSave:
    """An --async-save checkpoint being written in the background."""

    iteration: int
    path: str
    started: float
    """time.perf_counter() when training went on."""


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers down to the GPTModel."""
    while hasattr(module, "module"):
        module = module.module
    return module


def model_chunks(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The GPTModels of a model or of its chunks (one per virtual pipeline stage), wrappers stripped."""
    return [unwrap_model(chunk) for chunk in (model if isinstance(model, list) else [model])]


def model_keys(chunks: list[torch.nn.Module]) -> list[str]:
    """Where each chunk's weights sit in the state dict: `model`, or Megatron-LM's `model0`, `model1`, ...
    under the interleaved schedule. Only the nesting differs: every tensor's checkpoint key is global
    (layers by their global number), so any layout loads what any other saved."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _model_state(model: torch.nn.Module | list[torch.nn.Module]) -> dict:
    chunks = model_chunks(model)
    return {key: chunk.sharded_state_dict() for key, chunk in zip(model_keys(chunks), chunks, strict=True)}


def _load_model_state(model: torch.nn.Module | list[torch.nn.Module], loaded: dict) -> None:
    chunks = model_chunks(model)
    for key, chunk in zip(model_keys(chunks), chunks, strict=True):
        chunk.load_state_dict(loaded[key])


def _layout() -> dict[str, int]:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "vp": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        "dp": parallel_state.get_data_parallel_world_size(),
    }


def rng_device_type() -> str:
    """The device type the model-parallel RNG tracker draws on in this process."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def rng_state() -> dict:
    """This rank's RNG state: the default generator, the model-parallel tracker (with the device type its
    states belong to: CPU generator states and CUDA Philox states are not interchangeable), CUDA's."""
    from megatron.core import tensor_parallel

    state = {
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "device_type": rng_device_type(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def saved_rng_device_type(rng: dict) -> str:
    """The device type of a saved RNG state; checkpoints from before the field are told apart by their
    tracker states (a CUDA generator's Philox state is 16 bytes, the CPU Mersenne Twister's 5056)."""
    if "device_type" in rng:
        return rng["device_type"]
    states = list(rng.get("tracker", {}).values())
    return "cuda" if states and all(s.numel() == 16 for s in states) else "cpu"


def restore_rng_state(rng: dict, log: Callable[[str], None]) -> None:
    """Restore `rng_state()`'s output. Tracker states saved on another device type cannot be set here (they
    would fail at the next `fork()`): the tracker keeps its --seed states and one line says so."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(rng["torch"])  # CPU generator state: valid on any machine
    saved, here = saved_rng_device_type(rng), rng_device_type()
    if saved == here:
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    else:
        log(
            f" RNG: the model-parallel RNG states were saved on {saved} and cannot be restored on {here}; "
            f"they restart from --seed (dropout draws differ from an uninterrupted run)"
        )
    if "cuda" in rng and here == "cuda":
        torch.cuda.set_rng_state(rng["cuda"])


def _rng_object() -> ShardedObject:
    pp, tp = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    return ShardedObject(
        "rng_state",
        rng_state(),
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
    model: torch.nn.Module | list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    *,
    is_loading: bool,
    with_rng: bool,
) -> dict:
    model_sd = _model_state(model)
    state: dict = dict(model_sd)
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


def checkpoint_bytes(num_parameters: int, dtype: torch.dtype) -> int:
    """About how many bytes one checkpoint of a model of `num_parameters` weights in `dtype` takes: the
    weights, plus Adam's two fp32 moments and (bf16/fp16) the fp32 main copy of the weights."""
    weight = torch.tensor([], dtype=dtype).element_size()
    main_copy = 4 if weight < 4 else 0
    return num_parameters * (weight + main_copy + 8)


def _rank0_print(line: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def _same_path(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _stall_hook(iteration: int) -> HoldAfterWrite | None:
    """The `STALL_ASYNC_SAVE_ENV` test hook for this iteration's background write, if it names it (it runs
    in the writer process, which prints its line to the job's output)."""
    value = os.environ.get(STALL_ASYNC_SAVE_ENV, "")
    target, _, release = value.partition(":")
    if not target or int(target) != iteration or torch.distributed.get_rank() != 0:
        return None
    until = f"until {release} exists" if release else "until it is killed"
    message = (
        f" test hook {STALL_ASYNC_SAVE_ENV}: iteration {iteration}'s files are written; holding its save "
        f"back {until}"
    )
    return HoldAfterWrite(message, release or None)


class CheckpointManager:
    """Resuming and saving for the Trainer: --save made this run's alone (`lock_save_target`), where the run
    starts (`resolve`), restoring the model, optimizer, scheduler and RNG from there (`restore`: a resume,
    or the --pretrained-checkpoint weights alone), and saves (`due`, `save`).

    With --async-save a save returns once it is planned and this rank's tensors are copied into a shared
    host buffer (the snapshot), which this rank's one writer process, started with the manager and dying
    with the rank, writes to files (`diffmeg.compat.checkpoint_writer`). The files are written beside
    training; the save is finalized (index, metadata, args.json, then the tracker) on all ranks together by
    `poll` (every step, once every rank's files are written) or `wait` (blocking: before the next save and
    at the end of training). Every method here that may finalize is collective: all ranks call it at the
    same step. `close` stops the writer (at the end of training).
    """

    def __init__(self, run: RunConfig, log: Callable[[str], None] = _rank0_print) -> None:
        self.run = run
        self.config = run.checkpoint
        self.log = log
        self.start: StartPoint | None = None
        """The checkpoint the run starts from (`resolve`); None: from scratch."""
        self.checkpoint_bytes: int | None = None
        """About one checkpoint's size (from the model size, then measured): for disk-full messages."""
        self.pending: PendingSave | None = None
        """The --async-save checkpoint being written, not yet finalized (at most one)."""
        self._background: AsyncSaves | None = None
        self._lock: FolderLock | None = None
        """--save's lock, rank 0's (`lock_save_target`)."""
        if self.config.async_save and self.config.save is not None:
            self._background = AsyncSaves()
            self._background.start()  # its imports run while the model is built

    # ------------------------------------------------------------------------------------------ start

    def resolve(self) -> StartPoint | None:
        """Decide where the run starts, read that checkpoint once (`StartPoint`) and check it against the
        run, before anything is built: every bad --load, and every checkpoint this run cannot start from,
        is one line here. None: the run starts from scratch."""
        self.start = self._start_point()
        if self.start is not None:
            self._check_start(self.start)
        return self.start

    def _start_point(self) -> StartPoint | None:
        iteration = self._load_iteration()
        if iteration is not None:
            return read_start_point(self.config.load, iteration, resume=True, pick_flag="--ckpt-step")
        root = self.config.pretrained_checkpoint
        if root is None:
            return None
        iteration = read_tracker(root) if os.path.isdir(root) else None
        if iteration is None:
            raise DiffmegError(
                f"--pretrained-checkpoint {root} holds no complete checkpoint ({TRACKER_FILE})"
            )
        return read_start_point(root, iteration, resume=False)

    def _load_iteration(self) -> int | None:
        """The iteration of --load to resume (the rules of the module's docstring); None: none yet."""
        root, cfg = self.config.load, self.config
        if root is None:
            return None
        if os.path.exists(root) and not os.path.isdir(root):
            raise DiffmegError(f"--load {root} is a file, not a checkpoint directory")
        fresh_ok = _same_path(root, cfg.save) or cfg.pretrained_checkpoint is not None
        if not os.path.isdir(root) and not fresh_ok:
            raise DiffmegError(
                f"--load {root} does not exist (a typo? to start from scratch and save there, pass it as "
                f"--save too)"
            )
        if not os.path.isdir(root) or (cfg.ckpt_step is None and not holds_saves(root)):
            if not (fresh_ok or holds_only_run_files(root)):
                fix = "point --load at a checkpoint directory, or drop it to start from scratch"
                raise DiffmegError(not_a_checkpoint_message(root, fix))
            if cfg.pretrained_checkpoint is None:  # else the pretrained weights' line says where from
                self.log(f" no checkpoint in {root}, starting from scratch")
            return None
        iteration = resolve_iteration(root, cfg.ckpt_step, "--ckpt-step")
        train_iters = self.run.training.train_iters
        if iteration > train_iters and not cfg.finetune:  # it would load, train nothing and exit 0
            raise DiffmegError(
                f"--load {root} is at iteration {iteration}, past --train-iters {train_iters}: nothing to "
                f"train; raise --train-iters (or --train-tokens) above {iteration} to continue the run, or "
                f"add --finetune to train its weights on a new schedule"
            )
        return iteration

    def _check_start(self, start: StartPoint) -> None:
        """The checkpoint the run starts from has this run's model shape (`check_shape`), ties (or unties)
        its output layer as this run does (a tied checkpoint has no output-layer tensor to load, an untied
        one's would be dropped unseen), holds ids of this run's tokenizer, and (a resume that loads the
        optimizer) has this run's precision (`_check_precision`) and learning-rate schedule
        (`_check_schedule`)."""
        model = self.run.model
        check_shape(start.where, start.args, model)
        saved = bool(start.args["tie_embeddings_and_output_weights"])
        if saved and not model.tie_embeddings_and_output_weights:
            raise DiffmegError(
                f"{start.where} holds a model whose output layer is tied to its word embedding, but this run "
                f"unties them; add --tie-embeddings-and-output-weights (or --use-checkpoint-args) and drop "
                f"--untie-embeddings-and-output-weights"
            )
        if model.tie_embeddings_and_output_weights and not saved:
            raise DiffmegError(
                f"{start.where} holds a model with an output layer of its own, but this run ties it to the "
                f"word embedding; drop --tie-embeddings-and-output-weights"
            )
        check_checkpoint(start.args, record_of_args(vars(self.run.data)), start.where)
        if self._loads_optimizer(start):
            self._check_precision(start)
            self._check_schedule(start)

    def _check_precision(self, start: StartPoint) -> None:
        """A resume that loads the optimizer has the checkpoint's precision (its saved arguments' --bf16 /
        --fp16): a bf16 model's optimizer holds fp32 main weights an fp32 run has not, so the load fails
        deep in megatron-core (a KeyError, a missing tensor); one line says which flag matches, or that
        --no-load-optim loads the weights alone (they convert)."""
        saved = "bf16" if start.args.get("bf16") else "fp16" if start.args.get("fp16") else "fp32"
        ours = self.run.training.precision
        if saved == ours:
            return
        match = [f"drop --{ours}"] if ours != "fp32" else []
        match += [f"pass --{saved}"] if saved != "fp32" else []
        raise DiffmegError(
            f"{start.where} was saved with {saved} and this run is {ours}: {' and '.join(match)} to match, "
            f"or add --no-load-optim to load only the weights (a fresh optimizer)"
        )

    def _check_schedule(self, start: StartPoint) -> None:
        """The checkpoint the run resumes has this run's learning-rate schedule, or one line naming each
        difference and the two flags that settle it (Megatron-LM's rule).

        `--override-opt-param-scheduler`: this run's schedule from the checkpoint's iteration on;
        `--use-checkpoint-opt-param-scheduler`: the checkpoint's, whatever the flags say. A run that does
        not load the optimizer (--no-load-optim, --finetune, a weights-only checkpoint) starts its own."""
        saved = start.common.get("opt_param_scheduler")
        differences = [] if saved is None else schedule_differences(saved, self.run)
        optim = self.run.optim
        if not differences:
            return
        if optim.override_opt_param_scheduler or optim.use_checkpoint_opt_param_scheduler:
            whose = "this run's" if optim.override_opt_param_scheduler else "the checkpoint's"
            self.log(f" learning-rate schedule: {'; '.join(differences)}: {whose} is used")
            return
        raise DiffmegError(
            f"{start.where} was trained on another learning-rate schedule: {'; '.join(differences)}; "
            f"add --override-opt-param-scheduler to go on with this run's schedule from iteration "
            f"{start.iteration}, or --use-checkpoint-opt-param-scheduler to keep the checkpoint's"
        )

    def _loads_optimizer(self, start: StartPoint) -> bool:
        """Whether starting from `start` restores its optimizer and schedule: a resume, not with
        --no-load-optim or --finetune, nor from a weights-only checkpoint (an HF import)."""
        cfg = self.config
        if start.common is None:  # --pretrained-checkpoint: its weights only
            return False
        return not (cfg.no_load_optim or cfg.finetune or start.common.get(WEIGHTS_ONLY_KEY))

    def lock_save_target(self, num_parameters: int) -> None:
        """Make --save this run's alone before anything is written into it, with room for a checkpoint of
        the model (`num_parameters`, counted from the run's sizes): rank 0 makes it, takes its lock
        (`diffmeg.folder_lock`), names what earlier saves left there and checks its free space; another run
        holding it, a folder that cannot be made or written, or too little room stops every rank with the
        same one line, before anything is built. Held until `close`."""
        root = self.config.save
        if root is None:
            return
        self.checkpoint_bytes = need = checkpoint_bytes(num_parameters, self.run.training.params_dtype)

        def take() -> None:
            lock = FolderLock(root, "--save")
            note = lock.acquire()
            self._lock = lock
            if note is not None:
                self.log(note)
            if left := leftovers(root):
                shown = ", ".join(left[:4]) + (f" (and {len(left) - 4} more)" if len(left) > 4 else "")
                size = format_bytes(sum(directory_bytes(os.path.join(root, name)) for name in left))
                self.log(
                    f" {root} holds what earlier saves left ({size}): {shown}; no run removes what another "
                    f"wrote: delete them to free the space"
                )
            if (free := free_bytes(root)) < need:
                raise DiffmegError(
                    f"--save {root} has {format_bytes(free)} free, one checkpoint of this model needs about "
                    f"{format_bytes(need)}; free space or point --save elsewhere"
                )

        collectives.on_rank0(take)

    # ------------------------------------------------------------------------------------------ loading

    def restore(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
    ) -> tuple[int, int]:
        """Restore what `resolve` chose: a resume's model, optimizer, scheduler and RNG (what the flags and
        the checkpoint allow), or the --pretrained-checkpoint weights alone. Returns where to go on: the
        iteration and the consumed samples."""
        start, cfg = self.start, self.config
        if start is None:
            return 0, 0
        common = start.common or {}  # --pretrained-checkpoint: the weights, nothing else
        saved_layout = {"vp": 1, **common.get("layout", {})}  # no "vp": saved before interleaving existed
        same_model_layout = all(saved_layout.get(k) == _layout()[k] for k in ("tp", "pp", "vp"))
        # Pretrained weights, or a weights-only checkpoint (an HF import): no optimizer/scheduler/RNG state.
        weights_only = start.common is None or bool(common.get(WEIGHTS_ONLY_KEY))
        load_optim = self._loads_optimizer(start)
        if load_optim and self.run.parallel.use_distributed_optimizer and not same_model_layout:
            raise DiffmegError(
                f"distributed-optimizer state in {start.path} was saved at TP={saved_layout.get('tp')} "
                f"PP={saved_layout.get('pp')} VP={saved_layout['vp']} and cannot be resharded to this "
                f"layout; add --no-load-optim"
            )
        load_rng = not (cfg.no_load_rng or cfg.finetune or weights_only) and same_model_layout
        state = _state_dict(
            model,
            optimizer if load_optim else None,
            scheduler if load_optim else None,
            is_loading=True,
            with_rng=load_rng,
        )
        with torch.no_grad():  # the distributed optimizer copies into views of leaf parameters
            pick = "--ckpt-step" if start.common is not None else "--iteration"  # names another iteration
            loaded = load_sharded(state, start.path, pick_flag=pick)
            _load_model_state(model, loaded)
            if load_optim:
                if "optimizer" not in loaded:
                    raise DiffmegError(f"{start.path} has no optimizer state; add --no-load-optim")
                bounds = _lr_bounds(optimizer)
                optimizer.load_state_dict(loaded["optimizer"])
                _restore_distributed_optimizer_step(optimizer)
                if self.run.optim.override_opt_param_scheduler:
                    _set_lr_bounds(optimizer, bounds)  # the checkpoint's param groups carry its lr bounds
                scheduler.load_state_dict(loaded["opt_param_scheduler"])
        if load_rng:
            restore_rng_state(loaded["rng_state"], self.log)
        if start.common is None:
            self.log(
                f" initialised weights from pretrained checkpoint {cfg.pretrained_checkpoint} "
                f"(iteration {start.iteration}); optimizer, schedule and counters start fresh"
            )
            return 0, 0
        iteration, consumed_samples = 0, 0  # --finetune, a weights-only checkpoint: a new schedule
        if not (cfg.finetune or weights_only):
            iteration, consumed_samples = int(common["iteration"]), int(common["consumed_samples"])
        self.log(f" loaded checkpoint from {cfg.load} at iteration {iteration}")
        return iteration, consumed_samples

    # ------------------------------------------------------------------------------------------ saving

    def due(self, iteration: int, final: bool) -> bool:
        """Save at this iteration? Every --save-interval, at the last iteration and when stopping early."""
        return self.config.save is not None and (final or iteration % self.config.save_interval == 0)

    def save(
        self,
        iteration: int,
        consumed_samples: int,
        model: torch.nn.Module | list[torch.nn.Module],
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
    ) -> str:
        """Write `iter_N` on all ranks, then mark it latest; with --async-save in the background (the
        tracker moves when `poll` or `wait` finalizes it). A pending save is finished first. Returns the
        checkpoint directory."""
        self.wait()
        args = self.run.to_args()
        state = _state_dict(model, optimizer, scheduler, is_loading=False, with_rng=True)
        state.update(
            iteration=iteration,
            consumed_samples=consumed_samples,
            layout=_layout(),
            args=json.dumps(vars(args), default=str),
        )
        request = begin_checkpoint(self.config.save, iteration, state, args, self.checkpoint_bytes)
        path = checkpoint_path(self.config.save, iteration)
        if not self.config.async_save:
            run_now(request)
            self._saved(iteration, path)
            return path
        if self._background is None:
            self._background = AsyncSaves()
        self._background.after_write = _stall_hook(iteration)
        self._background.schedule_async_request(request)
        self.pending = PendingSave(iteration, path, time.perf_counter())
        self.log(f" saving checkpoint at iteration {iteration} to {path} in the background (--async-save)")
        return path

    def poll(self) -> None:
        """Finalize the pending --async-save checkpoint if every rank's files are written (one small
        all-reduce while a save is pending, none otherwise)."""
        if self.pending is not None:
            self._finalize(blocking=False)

    def wait(self) -> None:
        """Finalize the pending --async-save checkpoint, waiting for its files (before a new save, before
        exiting: at the end of training, --exit-interval, SIGTERM/SIGUSR1)."""
        if self.pending is not None:
            self.log(f" waiting for the background save of iteration {self.pending.iteration} to finish")
            self._finalize(blocking=True)

    def close(self) -> None:
        """Stop the --async-save writer process and free its buffer, then release --save's lock (not
        collective). Called at the end of training, after `wait`; a save still pending then (training failed)
        is abandoned: never finalized, its files removed, the tracker keeps naming the previous checkpoint."""
        if self._background is not None:
            self._background.close(abort=True)  # no finalize here: the other ranks may be elsewhere
            if self.pending is not None:
                abandon_save(self.config.save, self.pending.iteration)  # rank 0 removes what it wrote
            self._background, self.pending = None, None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _finalize(self, blocking: bool) -> None:
        pending = self.pending
        try:
            done = self._background.maybe_finalize_async_calls(blocking=blocking)
        except BaseException:
            self.pending = None  # a failed save is never retried: its error line says what is kept
            raise
        if done:
            self.pending = None
            self._saved(pending.iteration, pending.path, time.perf_counter() - pending.started)

    def _saved(self, iteration: int, path: str, background_s: float | None = None) -> None:
        if torch.distributed.get_rank() == 0:
            self.checkpoint_bytes = directory_bytes(path) or self.checkpoint_bytes  # measured from now on
        how = f" (written in the background in {background_s:.1f} s)" if background_s is not None else ""
        self.log(f" saved checkpoint at iteration {iteration} to {path}{how}")


SCHEDULE_FIELDS = (
    ("max_lr", "lr", "--lr"),
    ("min_lr", "min_lr", "--min-lr"),
    ("lr_warmup_steps", "lr_warmup_iters", "--lr-warmup-iters"),
    ("lr_decay_steps", "lr_decay_iters", "--lr-decay-iters"),
    ("lr_decay_style", "lr_decay_style", "--lr-decay-style"),
    ("start_wd", "weight_decay", "--weight-decay"),
)
"""What megatron-core's scheduler state records of a schedule: (its key, the run's field, the flag)."""


def schedule_differences(saved: dict, run: RunConfig) -> list[str]:
    """Each value of the learning-rate schedule where a checkpoint's scheduler state (`saved`) and the run
    differ, as "--flag run's (checkpoint: saved's)"."""
    explicit = run.extra.get("explicit_flags", ())
    differences = []
    for key, name, flag in SCHEDULE_FIELDS:
        ours, theirs = getattr(run.optim, name), saved.get(key)
        if theirs is None or ours == theirs:
            continue
        note = ""
        if name == "lr_decay_iters" and name not in explicit:
            note = f"; it follows --train-iters {run.training.train_iters} unless given"
        differences.append(f"{flag} {ours} (checkpoint: {theirs}{note})")
    return differences


def _lr_bounds(optimizer: MegatronOptimizer) -> list[tuple[float, float]]:
    """The (max_lr, min_lr) of every param group, as this run built them."""
    return [(group.get("max_lr"), group.get("min_lr")) for group in optimizer.param_groups]


def _set_lr_bounds(optimizer: MegatronOptimizer, bounds: list[tuple[float, float]]) -> None:
    """Put `_lr_bounds` back after loading the optimizer state: megatron-core's scheduler reads each
    group's bounds before its own, so without this --override-opt-param-scheduler would keep the
    checkpoint's --lr and --min-lr (Megatron-LM issue 1138)."""
    for group, (max_lr, min_lr) in zip(optimizer.param_groups, bounds, strict=True):
        if max_lr is not None:
            group["max_lr"] = max_lr
        if min_lr is not None:
            group["min_lr"] = min_lr


def check_shape(where: str, saved: dict, model: ModelConfig) -> None:
    """A checkpoint's model (its args.json, `saved`) has the run's shape, or one line naming each flag that
    differs and the fix: another iteration of the same run cannot help, every one has that shape."""
    differ = []
    for name in SHAPE_FIELDS:
        theirs, ours = saved.get(name, True if name == "diff_attention" else None), getattr(model, name)
        if name in ("diff_version", "num_noise_heads") and not (
            saved.get("diff_attention", True) and model.diff_attention
        ):
            continue  # the Transformer baseline has no DIFF version, no noise heads
        if name == "num_noise_heads":  # None (a run before grouped attention): one per differential head
            theirs = saved.get(name) or saved.get("num_attention_heads")
            ours = ours or model.num_attention_heads
        if theirs is None or ours is None or theirs == ours:
            continue
        if name == "diff_attention":
            kind = {True: "differential attention", False: "the Transformer baseline (--no-diff-attention)"}
            differ.append(f"{kind[bool(theirs)]} (this run: {kind[bool(ours)]})")
        else:
            differ.append(f"--{name.replace('_', '-')} {theirs} (this run: {ours})")
    if differ:
        raise DiffmegError(
            f"{where} holds a model of another shape: {', '.join(differ)}; pass the checkpoint's values, or "
            f"--use-checkpoint-args to take its shape from its args.json"
        )
