"""Upcycling as a conversion (`tools/convert_checkpoint.py upcycle`): open the source, stream it through
`diffmeg.conversion.upcycle`, write a weights-only DIFF V2 checkpoint.

The source is told apart by what the path holds:
- a pretrain_diff.py checkpoint (latest_checkpointed_iteration.txt): a Transformer (`transformer-*`,
  `--no-diff-attention`), read one layer at a time from any TP/PP layout it was saved in;
- a Hugging Face folder (config.json): LlamaForCausalLM, or MistralForCausalLM without a sliding window
  (its tensors and equations are Llama's); Qwen2 and anything else are refused in one line naming what
  our model cannot hold (Qwen2: the biases of q/k/v_proj). Read tensor by tensor (no memory map).

The DIFF V2 model's shape, RoPE base, norm epsilon, vocabulary and tied or untied output layer are the
source's. The source's tokenizer stays the model's: a Hugging Face folder's tokenizer files are copied into
`{save}/tokenizer` and recorded (diffmeg.conversion.tokenizer_io); a checkpoint's tokenizer flags
are carried over. Memory: one tensor outside the layers, or one layer and its upcycled copy, at a time.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diffmeg.conversion.hf_config import is_diff2_config
from diffmeg.conversion.layout import Diff2Layout, LlamaLayout
from diffmeg.conversion.tokenizer_io import FolderTokenizer, folder_tokenizer
from diffmeg.errors import DiffmegError

UPCYCLE_MODEL_TYPES = ("llama", "mistral")
"""Hugging Face model types that upcycle exactly (Mistral only without a sliding window)."""


@dataclass
class UpcycleSource:
    """A Transformer to upcycle: its layout, where its tensors come from, and what its args.json records
    besides the model's shape."""

    path: str
    description: str
    """What the path was found to hold (printed by the tool)."""
    layout: LlamaLayout
    dtype: torch.dtype
    """The dtype its weights are stored in."""
    seq_length: int
    init_method_std: float
    tokenizer: FolderTokenizer = field(default_factory=lambda: FolderTokenizer(None))
    """A Hugging Face tokenizer folder to keep with the model (None: cl100k_base or no tokenizer)."""
    data_flags: list[str] = field(default_factory=list)
    """pretrain_diff.py flags for the ids the model reads (--mock-data, --tokenizer-type null ...)."""
    blocks: Callable[[torch.dtype], Iterator[dict[str, torch.Tensor]]] | None = None
    """`blocks(dtype)`: the Transformer's TP=1 megatron-core tensors in `dtype`, each tensor outside the
    layers on its own, then one layer at a time."""


def llama_family_config(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """A Llama-family config.json as transformers' LlamaConfig reads it, or a one-line refusal naming what
    differs from a Llama."""
    import transformers

    model_type = raw.get("model_type")
    if model_type == "diffllama" or is_diff2_config(raw):
        kind = "DIFF V2" if is_diff2_config(raw) else model_type
        raise DiffmegError(f"{where} is already a DIFF model ({kind}); upcycling starts from a Transformer")
    if model_type == "qwen2":
        raise DiffmegError(
            f"{where} is a Qwen2 model: its q_proj, k_proj and v_proj have biases, which our attention (no "
            f"biases) cannot hold; only bias-free Llama-family models upcycle exactly"
        )
    if model_type == "mistral":
        window = transformers.MistralConfig.from_dict(dict(raw)).sliding_window
        positions = int(raw.get("max_position_embeddings", 32768))
        if window is not None and window < positions:
            raise DiffmegError(
                f"{where} is a Mistral model with sliding_window {window} < max_position_embeddings "
                f"{positions}: "
                f"our attention sees the whole context, so it would compute another function past {window} "
                f"tokens; set sliding_window to null in config.json only if the model was trained without it"
            )
        raw = {k: v for k, v in raw.items() if k != "sliding_window"}
        raw["model_type"] = "llama"  # Mistral without a window: Llama's tensors and equations
    elif model_type != "llama":
        raise DiffmegError(
            f"{where} has model_type {model_type!r}; upcycling takes a Llama-family model "
            f"({' or '.join(UPCYCLE_MODEL_TYPES)}), or a pretrain_diff.py Transformer checkpoint"
        )
    try:
        return transformers.LlamaConfig.from_dict(dict(raw)).to_dict()
    except Exception as exc:  # transformers validates the fields
        raise DiffmegError(f"invalid config.json in {where}: {str(exc).splitlines()[0][:200]}") from None


def _hf_source(path: str) -> UpcycleSource:
    from diffmeg.conversion.checkpoint_io import HFCheckpointReader
    from diffmeg.conversion.hf_import import open_hf_folder

    raw = HFCheckpointReader(path).raw_config
    folder = open_hf_folder(path, config=llama_family_config(raw, path))
    if not isinstance(folder.layout, LlamaLayout):
        raise DiffmegError(f"{path} is not a Llama-family model")
    arch = (raw.get("architectures") or [raw.get("model_type")])[0]
    tied = ", output layer tied to the embedding" if folder.layout.tied else ""
    return UpcycleSource(
        path=path,
        description=f"Hugging Face {arch} folder{tied}",
        layout=folder.layout,
        dtype=folder.dtype,
        seq_length=folder.layout.max_position_embeddings,
        init_method_std=float(folder.config.get("initializer_range", 0.02)),
        tokenizer=folder_tokenizer(path),
        blocks=folder.mcore_blocks,
    )


def _checkpoint_data_flags(args: argparse.Namespace, path: str) -> tuple[list[str], FolderTokenizer]:
    """The data / tokenizer flags of a checkpoint's run that the upcycled model keeps."""
    from diffmeg.data.hf_tokenizer import HF_TOKENIZER

    if getattr(args, "mock_data", False):
        return ["--mock-data"], FolderTokenizer(None)
    kind = getattr(args, "tokenizer_type", None) or "cl100k_base"
    if kind == "null":
        return ["--tokenizer-type", "null", "--data-path", *(args.data_path or [])], FolderTokenizer(None)
    if kind == HF_TOKENIZER:
        model = getattr(args, "tokenizer_model", None)
        if not model or not os.path.isdir(model):
            raise DiffmegError(
                f"{path} was trained with the Hugging Face tokenizer {model}, which is gone; the upcycled "
                f"model needs its tokenizer files: restore that folder"
            )
        return [], folder_tokenizer(model)
    return [], FolderTokenizer(None)


def _checkpoint_source(path: str) -> UpcycleSource:
    from diffmeg.conversion.checkpoint_io import McoreCheckpointReader
    from diffmeg.conversion.hf_config import layout_from_args
    from diffmeg.conversion.mapping import MCORE_LAYER_PREFIX

    reader = McoreCheckpointReader(path)
    args = reader.args
    if getattr(args, "diff_attention", True):
        version = "DIFF V2" if int(getattr(args, "diff_version", 1)) == 2 else "DIFF"
        raise DiffmegError(
            f"{reader.path} holds a {version} model; upcycling starts from a Transformer (transformer-* "
            f"presets, --no-diff-attention)"
        )
    layout = layout_from_args(args)
    reader.check(layout)
    data_flags, tokenizer = _checkpoint_data_flags(args, reader.path)

    def blocks(dtype: torch.dtype) -> Iterator[dict[str, torch.Tensor]]:
        for key in layout.mcore_global_shapes():  # one at a time: the embedding alone is several layers
            yield {k: v.to(dtype) for k, v in reader.read_globals(layout, [key]).items()}
        for index in range(layout.num_layers):
            prefix = MCORE_LAYER_PREFIX.format(index)
            yield {prefix + k: v.to(dtype) for k, v in reader.read_layer(layout, index).items()}

    return UpcycleSource(
        path=path,
        description=f"pretrain_diff.py Transformer checkpoint ({os.path.basename(reader.path)})"
        + (", output layer tied to the embedding" if layout.tied else ""),
        layout=layout,
        dtype=reader.dtype,
        seq_length=int(args.seq_length),
        init_method_std=float(getattr(args, "init_method_std", 0.02)),
        tokenizer=tokenizer,
        data_flags=data_flags,
        blocks=blocks,
    )


def open_upcycle_source(path: str) -> UpcycleSource:
    """The Transformer at `path`: a pretrain_diff.py checkpoint or a Hugging Face folder, by what it holds."""
    from diffmeg.checkpoints import TRACKER_FILE, holds_saves

    if not os.path.isdir(path):
        raise DiffmegError(f"--load {path} is not a directory")
    if holds_saves(path):  # an unfinished one too: its reader names the complete iterations
        return _checkpoint_source(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _hf_source(path)
    raise DiffmegError(
        f"--load {path} is neither a pretrain_diff.py checkpoint ({TRACKER_FILE}) nor a Hugging Face model "
        f"folder (config.json)"
    )


NOISE_HEADS_FLAG = "--num-noise-heads"


def refuse_grouped_target(extra: Sequence[str], heads: int) -> None:
    """Refuse grouped differential attention as the upcycle's target (`--num-noise-heads n` != h among the
    pretrain_diff.py flags after `--`), in one line saying why: only one noise head per head (r = 1) is
    function-preserving (DESIGN.md "Grouped differential attention")."""
    extra = list(extra)
    for at, flag in enumerate(extra):
        name, _, value = flag.partition("=")
        if name != NOISE_HEADS_FLAG:
            continue
        value = value or (extra[at + 1] if at + 1 < len(extra) else "")
        if not value.strip().isdigit() or not 1 <= int(value) < heads:
            continue  # n = h: today's exact upcycle by name; pretrain_diff.py's checks name the rest
        raise DiffmegError(
            f"upcycling into grouped differential attention ({NOISE_HEADS_FLAG} {int(value)} for {heads} "
            f"heads) is not exact: with several signal heads per noise head no bias-free sigmoid lambda "
            f"removes the shared noise map and the signal heads cannot all equal it, so it would be a warm "
            f"start, not the source's function; only one noise head per head ({NOISE_HEADS_FLAG} {heads}, "
            f"the default, over any KV grouping) upcycles exactly: leave {NOISE_HEADS_FLAG} out"
        )


def upcycled_args(
    source: UpcycleSource,
    extra: Sequence[str] = (),
    *,
    seq_length: int | None = None,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
) -> tuple[Diff2Layout, argparse.Namespace]:
    """The DIFF V2 layout and the arguments its checkpoint records (what pretrain_diff.py would resolve
    for it, validated for the intended TP/PP; `extra`: further pretrain_diff.py flags, never the shape)."""
    from diffmeg.conversion.hf_import import resolved_pretrain_args
    from diffmeg.conversion.upcycle import diff2_layout

    refuse_grouped_target(extra, source.layout.num_heads)
    target = diff2_layout(source.layout)
    resolved = resolved_pretrain_args(
        target,
        {"initializer_range": source.init_method_std},
        [*source.tokenizer.flags(), *source.data_flags, *extra],
        seq_length=seq_length or source.seq_length,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
    )
    source.tokenizer.record(resolved)
    return target, resolved


def write_upcycled(
    source: UpcycleSource,
    save: str,
    args: argparse.Namespace,
    dtype: torch.dtype,
    progress: Any = None,
) -> Diff2Layout:
    """Write the upcycled checkpoint to `save` (atomically: a failure leaves nothing behind), one part at a
    time; `progress.layer_done(n)` after each layer. Needs nothing of torch.distributed."""
    from diffmeg.conversion.checkpoint_io import release_freed_memory
    from diffmeg.conversion.mcore_writer import StreamingCheckpointWriter, part_of
    from diffmeg.conversion.output_dir import CONVERTED_CHECKPOINT, atomic_output_dir
    from diffmeg.conversion.upcycle import diff2_layout, upcycle_blocks
    from diffmeg.runtime import single_process

    target = diff2_layout(source.layout)
    single_process()
    needed = target.mcore_parameters() * dtype.itemsize
    with atomic_output_dir(save, CONVERTED_CHECKPOINT, needed_bytes=needed) as out:
        writer = StreamingCheckpointWriter(out, args, dtype)
        for block in upcycle_blocks(source.blocks(dtype), source.layout):
            writer.write(block)
            part = part_of(next(iter(block)))
            del block
            release_freed_memory()
            if progress is not None:
                progress.layer_done(part + 1) if isinstance(part, int) else progress.restart()
        writer.close()
        source.tokenizer.copy_into(out)
    return target
