"""Checkpoints on disk, for every reader and writer: training, conversion, generation, evaluation.

Layout (Megatron-LM's): `{root}/iter_{N:07d}/` holds one megatron-core distributed checkpoint plus the
resolved arguments as `args.json`; `{root}/latest_checkpointed_iteration.txt` names the newest complete
one. `write_checkpoint` is the one writer: the tracker is replaced atomically and only after every rank
finished, so a run killed mid-save resumes from the previous checkpoint. Model weights are layout-free
(one global key per tensor, layers stacked), so any TP/PP layout reads what any other wrote; the offline
readers here build the single-rank (TP=PP=1) model a checkpoint's arguments describe.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass

import torch

from diffmeg.errors import DiffmegError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
ARGS_FILE = "args.json"
WEIGHTS_ONLY_KEY = "weights_only"
"""Set in the common state of checkpoints that hold model weights and nothing else (HF imports)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The `--dtype` choices of the offline tools."""


# ----------------------------------------------------------------------------------------------------
# Paths and the tracker


def checkpoint_path(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """Iteration of the newest complete checkpoint under `root`, or None if there is none."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise DiffmegError(f"{path} should hold an iteration number, found {text[:40]!r}; fix or delete it")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    """Point `root`'s tracker at `iteration`, atomically (a reader sees the old or the new number)."""
    tmp = os.path.join(root, f"{TRACKER_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(iteration))
    os.replace(tmp, os.path.join(root, TRACKER_FILE))


def iteration_dirs(root: str) -> list[int]:
    """Iterations with an `iter_N` directory holding `args.json` (written last, so: finished saves)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(
        int(name[5:])
        for name in names
        if name.startswith("iter_")
        and name[5:].isdigit()
        and os.path.isfile(os.path.join(root, name, ARGS_FILE))
    )


# ----------------------------------------------------------------------------------------------------
# Writing


def _json_args(args: argparse.Namespace | dict) -> dict:
    return dict(args) if isinstance(args, dict) else vars(args)


def write_checkpoint(root: str, iteration: int, state: dict, args: argparse.Namespace | dict) -> str:
    """Save `state` (a megatron-core sharded state dict plus common entries) as `{root}/iter_N`.

    Called on every rank of the job (or by one process in a single-process group). Rank 0 clears an
    unfinished earlier save of the same iteration; `args.json` and then the tracker are written only
    after every rank's data is on disk. Returns the iteration directory.
    """
    from megatron.core import dist_checkpointing

    path = checkpoint_path(root, iteration)
    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(path):  # an earlier, unfinished save of this iteration (never marked latest)
            shutil.rmtree(path)
        os.makedirs(path)
    torch.distributed.barrier()
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(path, ARGS_FILE), "w") as f:
            json.dump(_json_args(args), f, indent=2, default=str)
        write_tracker(root, iteration)
    torch.distributed.barrier()
    return path


# ----------------------------------------------------------------------------------------------------
# Reading


def read_checkpoint_args(root: str, iteration: int | None = None) -> tuple[argparse.Namespace, str]:
    """The resolved arguments a checkpoint was trained with, and its directory (no weights are read)."""
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise DiffmegError(f"{root} holds no complete checkpoint ({TRACKER_FILE} is missing)")
    path = checkpoint_path(root, iteration)
    args_file = os.path.join(path, ARGS_FILE)
    if not os.path.isfile(args_file):
        raise DiffmegError(f"{path} is not a complete pretrain_diff.py checkpoint ({ARGS_FILE} is missing)")
    with open(args_file) as f:
        return argparse.Namespace(**json.load(f)), path


def first_line(exc: BaseException) -> str:
    """An exception's first message line (at most 300 characters), or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def load_sharded(state: dict, path: str) -> dict:
    """megatron-core's `dist_checkpointing.load` with one clear line for a damaged or foreign checkpoint."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        return dist_checkpointing.load(state, path)
    except (Exception, CheckpointException) as exc:  # many types for a damaged or foreign checkpoint
        raise DiffmegError(
            f"cannot load checkpoint {path}: {first_line(exc)} (is it complete and from pretrain_diff.py? "
            f"point --load elsewhere or remove the directory)"
        ) from exc


def single_rank_args(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of run arguments for one fp32 TP=PP=1 model (the layout checkpoints are read and built in)."""
    args = argparse.Namespace(**vars(args))
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = args.context_parallel_size = 1
    args.sequence_parallel = args.use_distributed_optimizer = False
    args.bf16 = args.fp16 = False
    args.fp8_format = None
    args.recompute_granularity = args.recompute_method = args.recompute_num_layers = None
    return args


def build_single_rank_model(args: argparse.Namespace, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The TP=PP=1 GPTModel `pretrain_diff.py` builds for these arguments, its weights in `dtype` (built in
    that dtype: no fp32 copy of a bf16 model). Needs `diffmeg.runtime.single_process()`."""
    from diffmeg.model import build_model
    from diffmeg.training.builders import config_from_args

    args = single_rank_args(args)
    args.bf16, args.fp16 = dtype == torch.bfloat16, dtype == torch.float16
    model = build_model(
        config_from_args(args),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        rotary_base=args.rotary_base,
        use_te=False,
        seed=args.seed,
        pre_process=True,
        post_process=True,
    )
    return model.to(dtype)  # the few tensors created in fp32 whatever the config (lambda vectors)


def load_model_weights(root: str, iteration: int | None = None, dtype: torch.dtype = torch.float32):
    """A single-rank (TP=PP=1) model with a checkpoint's weights, for inference, export and tests.

    Built in fp32, loaded, then cast, so every consumer (and an HF export) computes with the same
    numbers. Needs `diffmeg.runtime.single_process()`. Returns (model in eval mode, args).
    """
    args, path = read_checkpoint_args(root, iteration)
    model = build_single_rank_model(args, torch.float32)
    with torch.no_grad():
        loaded = load_sharded({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(loaded["model"])
    return model.to(dtype).eval(), single_rank_args(args)


# ----------------------------------------------------------------------------------------------------
# Checkpoints and Hugging Face folders as inputs of the evaluation tools


@dataclass
class CheckpointInfo:
    """What a tool needs to know about a checkpoint before loading its weights.

    A pretrain_diff.py checkpoint directory, or a Hugging Face DiffLlama / Llama folder (`hf` set; no
    iteration; `args` are those a pretrain_diff.py run of it would resolve, from config.json).
    """

    root: str
    iteration: int | None
    path: str
    args: dict
    label: str = ""
    hf: bool = False
    """A Hugging Face folder: its weights are mapped into the model in memory (no checkpoint written)."""

    @property
    def architecture(self) -> str:
        return "DIFF" if self.args.get("diff_attention", True) else "Transformer"

    @property
    def seq_length(self) -> int:
        return int(self.args["seq_length"])

    @property
    def vocab_size(self) -> int:
        return int(self.args["vocab_size"])

    @property
    def tokenizer(self) -> str:
        """The vocabulary its token ids mean: mock data and `--tokenizer-type null` ids are not cl100k's."""
        if self.args.get("mock_data") or self.args.get("tokenizer_type") == "null":
            return "mock"
        return "cl100k_base"


def read_checkpoint_info(root: str, iteration: int | None = None) -> CheckpointInfo:
    """The arguments a checkpoint was trained with (cheap: no weights are read).

    A folder with config.json (a Hugging Face DiffLlama / Llama) is accepted too: its arguments come
    from config.json (seq_length = max_position_embeddings; tokenizer cl100k_base when the vocabulary
    holds cl100k's ids, else mock), its tensors are checked from the safetensors headers only.
    """
    from diffmeg.conversion.hf_import import is_hf_folder

    if not os.path.isdir(root):
        raise DiffmegError(f"--load {root} is not a directory")
    if is_hf_folder(root):
        from diffmeg.conversion.hf_import import analysis_args, open_hf_folder

        if iteration is not None:
            raise DiffmegError(
                f"--iteration {iteration} does not apply to {root}: a Hugging Face folder holds one model"
            )
        args = analysis_args(open_hf_folder(root))
        return CheckpointInfo(root=root, iteration=None, path=root, args=vars(args), hf=True)
    args, path = read_checkpoint_args(root, iteration)
    resolved = int(os.path.basename(path).removeprefix("iter_"))
    return CheckpointInfo(root=root, iteration=resolved, path=path, args=vars(args))


def load_checkpoint_model(info: CheckpointInfo, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The single-rank model of a checkpoint or Hugging Face folder, in eval mode and `dtype`.

    Needs `diffmeg.runtime.single_process()`. Both are built the same way (fp32, then cast), so a
    Hugging Face export of a checkpoint gives the checkpoint's numbers.
    """
    if info.hf:
        from diffmeg.conversion.hf_import import load_hf_model, open_hf_folder

        return load_hf_model(open_hf_folder(info.root), argparse.Namespace(**info.args), dtype)
    model, _ = load_model_weights(info.root, info.iteration, dtype=dtype)
    return model
