"""Checkpoints on disk, for every reader and writer: training, conversion, generation, evaluation.

Layout (Megatron-LM's): `{root}/iter_{N:07d}/` holds one megatron-core distributed checkpoint plus the
resolved arguments as `args.json`; `{root}/latest_checkpointed_iteration.txt` names the newest complete
one. `begin_checkpoint` is the one writer (`diffmeg.compat.checkpoint_writer.run_now` runs its request at
once, training's --async-save in the background): each save writes into a folder of its own, renamed to
`iter_N` once complete, and the tracker is replaced atomically and only after every rank finished, so a
run killed mid-save resumes from the previous checkpoint, and a failed save removes only what it wrote.
Model weights are layout-free (one global key per tensor, layers stacked), so any TP/PP layout reads what
any other wrote; the offline readers here build the single-rank (TP=PP=1) model a checkpoint's arguments
describe.
"""

from __future__ import annotations

import argparse
import filecmp
import io
import json
import os
import pickle
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from diffmeg import registry
from diffmeg.data.hf_tokenizer import HF_TOKENIZER, TOKENIZER_FILES, copy_tokenizer_files, has_tokenizer_files
from diffmeg.errors import DiffmegError
from diffmeg.folder_lock import LOCK_FILE
from diffmeg.storage import directory_bytes, format_bytes, free_bytes, is_disk_full

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

TRACKER_FILE = "latest_checkpointed_iteration.txt"
ARGS_FILE = "args.json"
ARGUMENTS_FILE = "arguments.json"
"""The full resolved arguments of a run's latest start, in its run directory (`diffmeg.training.logger`)."""
HF_CONFIG_FILE = "config.json"
"""What makes a folder a Hugging Face model (`diffmeg.model_source.is_hf_folder`), never a checkpoint."""
WEIGHTS_ONLY_KEY = "weights_only"
"""Set in the common state of checkpoints that hold model weights and nothing else (HF imports)."""
TOKENIZER_DIR = "tokenizer"
"""A run's own copy of its Hugging Face tokenizer, `{root}/tokenizer`: args.json names it by this relative
path, so a checkpoint folder that is moved, renamed or copied keeps its tokenizer."""
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
    tmp = _own_name(os.path.join(root, f"{TRACKER_FILE}.tmp"))
    try:
        with open(tmp, "x") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER_FILE))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _own_name(prefix: str) -> str:
    """`prefix-HOST-PID-XXXXXX`: a name no other process, on any node, picks (for files made with "x" or
    mkdir, which fail if it exists, so that what a writer removes on failure is what it made)."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


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


def holds_saves(root: str) -> bool:
    """`root` has a tracker or an iter_* directory: a checkpoint directory, complete or not."""
    return read_tracker(root) is not None or any(name.startswith("iter_") for name in os.listdir(root))


def holds_hf_export(root: str) -> bool:
    """`root` is a Hugging Face model folder as `tools/convert_checkpoint.py` exports one: config.json with
    safetensors weights (one file or an index of shards), and no checkpoint tracker."""
    if not os.path.isfile(os.path.join(root, HF_CONFIG_FILE)) or read_tracker(root) is not None:
        return False
    return any(
        name.endswith(".safetensors") or name == "model.safetensors.index.json" for name in os.listdir(root)
    )


def holds_only_run_files(root: str) -> bool:
    """Empty, or only what a run writes before its first checkpoint (its lock, its arguments, temporaries)."""
    return all(
        name in (ARGUMENTS_FILE, LOCK_FILE) or name.startswith(f"{TRACKER_FILE}.tmp-")
        for name in os.listdir(root)
    )


def resolve_iteration(root: str, iteration: int | None = None, pick_flag: str = "--iteration") -> int:
    """The complete iteration of checkpoint directory `root` a reader loads: `iteration`, else the one the
    tracker names. Every reader resolves through here (the tools' `--iteration`, training's `--ckpt-step`),
    so one asked for that is missing or unfinished, a tracker naming one, a folder with no checkpoint at all
    or a Hugging Face folder is one line: what was asked, what is there, the complete iterations and the fix.
    """
    if not holds_saves(root):
        raise DiffmegError(not_a_checkpoint_message(root))
    complete = iteration_dirs(root)
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise DiffmegError(
                f"{root} has no {TRACKER_FILE}: its last save did not finish; "
                f"{complete_iterations(root, complete, pick_flag)}"
            )
        asked = f"{TRACKER_FILE} in {root} names iteration {iteration}, but"
    else:
        asked = f"{pick_flag} {iteration}:"
    if iteration in complete:
        return iteration
    path = checkpoint_path(root, iteration)
    state = "is missing" if not os.path.isdir(path) else f"is incomplete (no {ARGS_FILE}: an unfinished save)"
    raise DiffmegError(f"{asked} {path} {state}; {complete_iterations(root, complete, pick_flag)}")


def complete_iterations(root: str, iterations: list[int], pick_flag: str, other: bool = False) -> str:
    """The clause that lists the complete `iterations` of `root` (the last 8) and how to pick one."""
    other_ = "other " if other else ""
    if not iterations:
        return f"no {other_}complete iteration in {root}; point the run at another checkpoint"
    listed = ", ".join(map(str, iterations[-8:]))
    if len(iterations) > 8:
        listed += f" (and {len(iterations) - 8} earlier)"
    return f"{other_}complete iterations in {root}: {listed}; start from one with {pick_flag} N"


def not_a_checkpoint_message(root: str, fix: str = "point --load at a checkpoint directory") -> str:
    """Why --load `root`, a directory holding no tracker and no iter_* directories, is no checkpoint, and
    `fix`; a Hugging Face model folder is named as one, with the command that converts it instead."""
    if os.path.isfile(os.path.join(root, HF_CONFIG_FILE)):
        return (
            f"--load {root} is a Hugging Face model folder ({HF_CONFIG_FILE}), not a pretrain_diff.py "
            f"checkpoint; convert it with: python tools/convert_checkpoint.py hf-to-mcore --load {root} "
            f"--save CKPT_DIR"
        )
    return f"--load {root} is not a checkpoint directory (no {TRACKER_FILE}, no iter_* directories); {fix}"


# ----------------------------------------------------------------------------------------------------
# The tokenizer a checkpoint carries


def carry_tokenizer(root: str, args: dict) -> dict:
    """`args` as args.json records them under `root`: a Hugging Face tokenizer folder outside `root` is
    copied into `{root}/tokenizer` once, and named by that relative path (a copy of `args`).

    So a run no longer depends on the upcycle or import folder it started from, nor on where it lies."""
    model = args.get("tokenizer_model")
    if args.get("tokenizer_type") != HF_TOKENIZER or not model or not os.path.isabs(model):
        return args  # no folder, or already named relative to `root`
    own = os.path.join(root, TOKENIZER_DIR)
    if os.path.realpath(model) != os.path.realpath(own):
        if has_tokenizer_files(own):
            if not _same_tokenizer_files(model, own):
                raise DiffmegError(
                    f"{own} holds another tokenizer than this run's {model}; save this run to another --save "
                    f"folder (a checkpoint folder carries one tokenizer)"
                )
        else:
            tmp = _own_name(f"{own}.tmp")
            try:
                os.makedirs(tmp)  # fails if it exists: the folder removed below is the one made here
                copy_tokenizer_files(model, tmp)
                os.replace(tmp, own)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return {**args, "tokenizer_model": TOKENIZER_DIR}


def _same_tokenizer_files(a: str, b: str) -> bool:
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(a, n))]
    return names == [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(b, n))] and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names
    )


def locate_tokenizer(root: str, args: dict) -> dict:
    """args.json's values with the tokenizer folder where it is now: a relative `tokenizer_model` lies under
    `root`; an absolute one that is gone (a checkpoint written before runs carried their tokenizer) falls
    back to `{root}/tokenizer` when the run holds a copy."""
    model = args.get("tokenizer_model")
    if args.get("tokenizer_type") != HF_TOKENIZER or not model:
        return args
    own = os.path.abspath(os.path.join(root, TOKENIZER_DIR))
    if not os.path.isabs(model):
        return {**args, "tokenizer_model": os.path.abspath(os.path.join(root, model))}
    if not os.path.isdir(model) and has_tokenizer_files(own):
        return {**args, "tokenizer_model": own}
    return args


# ----------------------------------------------------------------------------------------------------
# Writing


def _json_args(args: argparse.Namespace | dict) -> dict:
    return dict(args) if isinstance(args, dict) else dict(vars(args))


def begin_checkpoint(
    root: str,
    iteration: int,
    state: dict,
    args: argparse.Namespace | dict,
    expected_bytes: int | None = None,
) -> AsyncRequest:
    """The first part of saving `state` as `{root}/iter_N`, on every rank: rank 0 makes this save's own
    folder `iter_N.saving-...` beside it, writes the common state there, all ranks plan their tensors' files.

    Returns megatron-core's `AsyncRequest`: its `async_fn` writes this rank's files (now, or in the background
    with --async-save), then its one finalize function, called on all ranks once every rank's files are
    written, writes the index (`.metadata`), `metadata.json` and `args.json`, renames the folder to `iter_N`
    and, last, moves the tracker. So `iter_N` only ever names a complete checkpoint, and the tracker names an
    iteration only when every rank's part of it is on disk. An `iter_N` already there (a run that went back
    with --ckpt-step, or started over in this folder) is kept as `iter_N.replaced-...`, never deleted.

    A save that fails (a full disk above all), here or at the finalize, raises one `DiffmegError` line naming
    the directory, the free space and the checkpoint's size (`expected_bytes`, the caller's estimate, else
    what was written); rank 0 removes what this save wrote, and nothing else: the tracker keeps naming the
    previous checkpoint, which is untouched, whoever wrote it.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    from diffmeg import collectives
    from diffmeg.compat.checkpoint_writer import use_in_process_results_queue

    path = checkpoint_path(root, iteration)
    rank = torch.distributed.get_rank()
    use_in_process_results_queue()  # no helper process for the writer's results
    staging = None
    try:
        staging = collectives.on_rank0(lambda: _saving_dir(root, iteration))  # every rank writes there
        if rank == 0:
            _SAVING[path] = staging
        request = dist_checkpointing.save(state, staging, async_sharded_save=True)
    except (Exception, CheckpointException) as exc:  # no collective here: the other ranks may be elsewhere
        raise _failed_save(root, iteration, exc, expected_bytes, staging, rank == 0) from exc
    steps = list(request.finalize_fns)  # megatron-core's: the index and metadata.json, then a barrier

    def finalize() -> None:
        placed, aside = False, None
        try:
            for step in steps:
                step()
            if rank == 0:
                with open(os.path.join(staging, ARGS_FILE), "w") as f:
                    json.dump(carry_tokenizer(root, _json_args(args)), f, indent=2, default=str)
                aside = _move_aside(path)
                os.rename(staging, path)
                placed = True
                _SAVING.pop(path, None)
                write_tracker(root, iteration)
        except (Exception, CheckpointException) as exc:
            ours = path if placed else staging
            raise _failed_save(root, iteration, exc, expected_bytes, ours, rank == 0, aside) from exc
        if aside is not None:
            print(
                f" {path} was there already (an earlier save of iteration {iteration}): kept as "
                f"{os.path.basename(aside)}; delete it when it is no longer needed",
                flush=True,
            )
        torch.distributed.barrier()

    return request._replace(finalize_fns=[finalize])


_SAVING: dict[str, str] = {}
"""This process's saves not finished yet (rank 0's): `iter_N` -> the folder it is being written in."""
SAVING = ".saving"
"""`iter_N.saving-HOST-PID-XXXXXX`: a save being written (the folder it is renamed from to `iter_N`)."""
REPLACED = ".replaced"
"""`iter_N.replaced-TIME`: a checkpoint of iteration N that a later save of N replaced, kept."""


def _saving_dir(root: str, iteration: int) -> str:
    """A new folder of this save's own beside `iter_N` (rank 0): only this process writes or removes it."""
    try:
        os.makedirs(root, exist_ok=True)
        staging = _own_name(f"{checkpoint_path(root, iteration)}{SAVING}")
        os.mkdir(staging)
    except OSError as exc:
        why = exc.strerror or exc
        raise DiffmegError(f"cannot make a folder for iteration {iteration} in {root}: {why}") from exc
    return staging


def _move_aside(path: str) -> str | None:
    """Rename an existing `path` (an earlier checkpoint of this iteration) out of the way; its new name."""
    if not os.path.lexists(path):
        return None
    aside = f"{path}{REPLACED}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    if os.path.lexists(aside):
        aside += f"-{os.getpid()}"
    os.rename(path, aside)
    return aside


def abandon_save(root: str, iteration: int) -> None:
    """Remove the folder of this process's unfinished save of iteration N: an --async-save checkpoint that
    will never be finalized (training stopped on an error while it was written). Nothing on other ranks."""
    staging = _SAVING.pop(checkpoint_path(root, iteration), None)
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


def leftovers(root: str) -> list[str]:
    """What earlier saves left in `root`: unfinished ones (`iter_N.saving-...`: their run died while writing
    them) and replaced ones (`iter_N.replaced-...`). No run removes another's; the names, sorted."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(n for n in names if n.startswith("iter_") and (f"{SAVING}-" in n or f"{REPLACED}-" in n))


def _failed_save(
    root: str,
    iteration: int,
    exc: BaseException,
    expected_bytes: int | None,
    ours: str | None,
    clean: bool,
    aside: str | None = None,
) -> DiffmegError:
    """The one-line error of a failed save. With `clean` (rank 0) this save's folder `ours` is removed first
    and an earlier checkpoint of the iteration it moved `aside` goes back to its name: nothing else is
    touched, so the tracker still names what it named, as complete as it was."""
    name = os.path.basename(checkpoint_path(root, iteration))
    written = directory_bytes(ours) if ours else 0
    full = is_disk_full(exc) or (expected_bytes is not None and free_bytes(root) < expected_bytes - written)
    if clean:
        _SAVING.pop(checkpoint_path(root, iteration), None)
        if ours:
            shutil.rmtree(ours, ignore_errors=True)
        if aside is not None:
            os.replace(aside, checkpoint_path(root, iteration))
    size = expected_bytes if expected_bytes is not None else written
    removed = f"removed this save's partial {name}" if clean else "rank 0 removes this save's partial files"
    kept = _latest_kept(root)
    if full:
        return DiffmegError(
            f"disk full while saving iteration {iteration} to {root}: {format_bytes(free_bytes(root))} free, "
            f"the checkpoint needs about {format_bytes(size)}; {removed}, {kept} in {TRACKER_FILE} "
            f"(free space or point --save elsewhere, then resume)"
        )
    return DiffmegError(
        f"cannot save iteration {iteration} to {root}: {first_line(exc)}; {removed}, {kept} in {TRACKER_FILE}"
    )


def _latest_kept(root: str) -> str:
    """What the tracker names after a failed save, checked: a complete checkpoint, or what is wrong."""
    try:
        latest = read_tracker(root)
    except DiffmegError:
        return "an unreadable tracker"
    if latest is None:
        return "no earlier checkpoint"
    if latest in iteration_dirs(root):
        return f"the latest checkpoint is still iteration {latest}"
    return f"no complete checkpoint of iteration {latest}, which the tracker names"


# ----------------------------------------------------------------------------------------------------
# Reading


def read_checkpoint_args(root: str, iteration: int | None = None) -> tuple[argparse.Namespace, str]:
    """The resolved arguments a checkpoint was trained with, and its directory (no weights are read)."""
    if not os.path.isdir(root):
        raise DiffmegError(f"--load {root} is not a directory")
    iteration = resolve_iteration(root, iteration)
    return saved_args(root, iteration), checkpoint_path(root, iteration)


@dataclass(frozen=True)
class StartPoint:
    """The checkpoint a training run starts from, read once before anything is built
    (`diffmeg.training.checkpointing.CheckpointManager.resolve`): every start-up check and the restore read it
    here, never the checkpoint's files again."""

    path: str
    """Its `iter_N` directory."""
    iteration: int
    args: dict
    """Its args.json, upgraded (`upgrade_saved_args`): the model's shape, the tied output layer, the
    tokenizer it was trained on."""
    common: dict | None = None
    """A resume's common state (counters, scheduler state, layout); None: its weights only."""

    @property
    def where(self) -> str:
        return f"checkpoint {self.path}"


def read_start_point(root: str, iteration: int, resume: bool, pick_flag: str = "--iteration") -> StartPoint:
    """Complete iteration `iteration` of `root` as a run starts from it: its arguments and, to `resume`, its
    common state (a damaged one is one line naming it and the other iterations `pick_flag` selects)."""
    path, common = checkpoint_path(root, iteration), None
    if resume:
        from megatron.core import dist_checkpointing

        try:
            common = dist_checkpointing.load_common_state_dict(path)
        except Exception as exc:  # a damaged common.pt: one line naming it, never torch's unsafe advice
            raise DiffmegError(damaged_checkpoint_message(path, exc, pick_flag)) from exc
    return StartPoint(path, iteration, vars(upgrade_saved_args(saved_args(root, iteration))), common)


def saved_args(root: str, iteration: int) -> argparse.Namespace:
    """The resolved arguments complete iteration `iteration` of `root` was trained with (its args.json)."""
    with open(os.path.join(checkpoint_path(root, iteration), ARGS_FILE)) as f:
        return argparse.Namespace(**locate_tokenizer(root, json.load(f)))


def first_line(exc: BaseException) -> str:
    """An exception's first message line (at most 300 characters), or its type's name. For a
    torch.distributed.checkpoint CheckpointException ("CheckpointException ranks:...") its first failure's."""
    failures = getattr(exc, "failures", None)
    if failures:
        failure = next(iter(failures.values()))
        return first_line(failure[0] if isinstance(failure, tuple) else failure)
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def load_sharded(state: dict, path: str, pick_flag: str = "--iteration") -> dict:
    """megatron-core's `dist_checkpointing.load`, with one clear line for a damaged or foreign checkpoint:
    the file that failed, the iteration, and the other complete iterations beside it (which `pick_flag`
    selects: training's `--ckpt-step`, the tools' `--iteration`)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        return dist_checkpointing.load(state, path)
    except (Exception, CheckpointException) as exc:  # many types for a damaged or foreign checkpoint
        raise DiffmegError(damaged_checkpoint_message(path, exc, pick_flag)) from exc


def damaged_checkpoint_message(path: str, exc: BaseException, pick_flag: str = "--iteration") -> str:
    """One line: which file of `path` failed and how, and which other iterations can be loaded instead."""
    root, name = os.path.split(os.path.normpath(path))
    iteration = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
    where = f"iteration {iteration} of {root}" if iteration is not None else path
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    # Reading every chunk again is for one rank only (the others name the damage as the loader saw it).
    damage = damaged_file(path, deep=rank == 0)
    what = f"{damage[0]} {damage[1]}" if damage else first_line(exc)
    others = [i for i in iteration_dirs(root) if i != iteration]
    choice = complete_iterations(root, others, pick_flag, other=True)
    return f"cannot load checkpoint {where}: {what}; {choice}"


def damaged_file(path: str, deep: bool = True) -> tuple[str, str] | None:
    """The first file of checkpoint directory `path` that cannot be read, and why (None: nothing found).

    Checks megatron-core's metadata.json and common.pt, torch.distributed.checkpoint's index (.metadata),
    that every indexed chunk lies inside its file, and with `deep` that every tensor chunk deserialises
    (this reads the whole checkpoint: done only after a load failed).
    """
    name = os.path.basename(os.path.normpath(path))

    def why(exc: BaseException) -> str:  # the first sentence is enough to tell the damage apart
        return first_line(exc).split(". ")[0][:160]

    def rel(file: str) -> str:
        return f"{name}/{file}"

    if not os.path.isdir(path):
        return path, "is missing"
    for file, reader in (("metadata.json", lambda f: json.load(f)), ("common.pt", None)):
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            return rel(file), "is missing"
        try:
            if reader is not None:
                with open(full) as f:
                    reader(f)
            else:
                torch.load(full, map_location="cpu", weights_only=False)
        except Exception as exc:
            return rel(file), f"cannot be read ({why(exc)})"
    index_file = os.path.join(path, ".metadata")
    if not os.path.isfile(index_file):
        return rel(".metadata"), "is missing"
    try:
        with open(index_file, "rb") as f:
            index = pickle.load(f)
        items = list(index.storage_data.items())
    except Exception as exc:
        return rel(".metadata"), f"cannot be read ({why(exc)})"
    sizes: dict[str, int] = {}
    for _, info in items:
        file = os.path.join(path, info.relative_path)
        if info.relative_path not in sizes:
            if not os.path.isfile(file):
                return rel(info.relative_path), "is missing"
            sizes[info.relative_path] = os.path.getsize(file)
        if sizes[info.relative_path] < info.offset + info.length:
            end = info.offset + info.length
            return rel(info.relative_path), f"is {sizes[info.relative_path]} bytes, its index expects {end}+"
    if not deep:
        return None
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, info in sorted(items, key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if getattr(info, "transform_descriptors", None):
            continue  # a compressed or otherwise transformed chunk
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            chunk = f.read(info.length)
        # Tensors and objects alike are torch.save'd chunks (torch.distributed.checkpoint saves objects so).
        tensor = isinstance(index.state_dict_metadata.get(key.fqn), TensorStorageMetadata)
        try:
            torch.load(io.BytesIO(chunk), map_location="cpu", weights_only=tensor)
        except Exception as exc:
            return rel(info.relative_path), f"holds an unreadable entry {key.fqn!r} ({why(exc)})"
    return None


SAVED_ARGS_DEFAULTS: dict[str, object] = {
    "diff_version": 1,  # DIFF V2 came later: every earlier run is the paper's DIFF
    "num_noise_heads": None,  # grouped attention came later: as many noise heads as differential heads
    "mlp_activation": "swiglu",  # PolyNorm came with Motif's models: every earlier MLP was SwiGLU
    "virtual_pipeline_model_parallel_size": None,  # interleaving came later: one model chunk per rank
    "cp_comm_type": None,  # megatron-core's default context-parallel exchange
    "tie_embeddings_and_output_weights": False,  # the output layer was always its own matrix
    "deterministic_mode": False,
    "cross_entropy_chunk_size": None,  # the whole logits
    "cross_entropy_loss_fusion": False,  # megatron-core's unfused loss
    **{s.field: registry.AUTO for s in registry.flagged()},  # each implementation flag: its slot's auto
    "compile_layers": False,  # eager layers
    "cuda_graph_impl": "none",  # no CUDA graphs
    "gradient_accumulation_fusion": False,  # DDP's hook added each weight gradient to main_grad
}
"""What a flag added after a checkpoint was written meant for the runs that did not have it yet."""
RETIRED_SAVED_ARGS = ("rope_impl", "diff_epilogue_impl")
"""Flags that left (their compiled variants gave way to `--compile-layers`): older args.json files hold
them; upgraded arguments do not, whatever they said (the eager path is what remains)."""


def upgrade_saved_args(args: argparse.Namespace | dict) -> argparse.Namespace:
    """A copy of a checkpoint's saved arguments with the flags it predates set to what those runs did
    (`SAVED_ARGS_DEFAULTS`) and the flags that left dropped (`RETIRED_SAVED_ARGS`), so readers of older
    args.json files need no defaults of their own."""
    values = dict(args) if isinstance(args, dict) else vars(args)
    kept = {name: value for name, value in values.items() if name not in RETIRED_SAVED_ARGS}
    return argparse.Namespace(**{**SAVED_ARGS_DEFAULTS, **kept})


def single_rank_args(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of run arguments for one fp32 TP=PP=1 model (the layout checkpoints are read and built in);
    older saved arguments are upgraded (`upgrade_saved_args`)."""
    args = upgrade_saved_args(args)
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = args.context_parallel_size = 1
    args.virtual_pipeline_model_parallel_size = args.num_layers_per_virtual_pipeline_stage = None
    args.sequence_parallel = args.use_distributed_optimizer = False
    args.bf16 = args.fp16 = False
    args.fp8_format = None
    args.sdpa_backend, args.cuda_graph_impl = "auto", "none"  # a run's GPU speed choices, not its weights
    args.gradient_accumulation_fusion = False  # a training-only fusion: no DDP main_grad here
    args.recompute_granularity = args.recompute_method = args.recompute_num_layers = None
    return args


def build_single_rank_model(args: argparse.Namespace, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The TP=PP=1 GPTModel `pretrain_diff.py` builds for these arguments, its weights in `dtype` (built in
    that dtype: no fp32 copy of a bf16 model). Needs `diffmeg.runtime.single_process()`."""
    from diffmeg.model import build_model, transformer_config
    from diffmeg.run_config import RunConfig

    args = single_rank_args(args)
    args.bf16, args.fp16 = dtype == torch.bfloat16, dtype == torch.float16
    model = build_model(
        transformer_config(RunConfig.from_args(args, partial=True)),
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
