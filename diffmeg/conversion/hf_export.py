"""A pretrain_diff.py checkpoint -> a Hugging Face folder, streamed one layer at a time.

The one exporter behind `tools/convert_checkpoint.py mcore-to-hf` and `pretrain_diff.py
--export-hf-at-end`: any TP/PP layout (checkpoints are layout-free), config.json, safetensors shards with
their index, generation_config.json, the remote code a layout needs and the tokenizer. Memory: about two
layers, whatever the depth. The folder is written beside / inside the target and moved into place only
when complete (`output_dir.atomic_output_dir`), so a failure never leaves half an export.
"""

from __future__ import annotations

import math
import os
import shlex
import time
from collections.abc import Callable

import torch

from diffmeg.checkpoints import read_tracker
from diffmeg.conversion.checkpoint_io import (
    McoreCheckpointReader,
    release_freed_memory,
    save_hf_tokenizer,
    save_remote_code,
)
from diffmeg.conversion.hf_config import (
    SOURCE_CONFIG_ARG,
    generation_config_dict,
    hf_config_dict,
    layout_from_args,
    motif_config_dict,
    transformers_config_class,
)
from diffmeg.conversion.layout import GLOBALS, MotifLayout
from diffmeg.conversion.mapping import HF_LAYER_PREFIX, hf_export_dtype, hf_model_shapes, mcore_layer_to_hf
from diffmeg.conversion.output_dir import HF_EXPORT, atomic_output_dir, check_output_path, some_names
from diffmeg.conversion.progress import Progress, clock
from diffmeg.conversion.safetensors_io import SafetensorsShardWriter
from diffmeg.conversion.tokenizer_io import export_tokenizer
from diffmeg.errors import stderr
from diffmeg.storage import write_json

DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's own default shard size


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_checkpoint(
    load: str,
    save: str,
    *,
    iteration: int | None = None,
    dtype: torch.dtype | None = None,
    tokenizer_file: str | None = None,
    tokenizer_model: str | None = None,
    no_tokenizer: bool = False,
    max_shard_size: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    log: Callable[[str], None] = stderr,
) -> str:
    """Export iteration `iteration` (default: the latest complete one) of the checkpoint folder `load`
    into the Hugging Face folder `save`; returns the summary line (also printed on stdout)."""
    import transformers  # only this direction needs it (its config and generation-config classes)

    start = time.perf_counter()
    kept = check_output_path(save, overwrite, load, HF_EXPORT)
    reader = McoreCheckpointReader(load, iteration)  # plain file reads: no process group needed
    layout = layout_from_args(reader.args)
    reader.check(layout)
    dtype = dtype or reader.dtype
    tokenizer = export_tokenizer(
        vars(reader.args),
        layout.vocab_size,
        layout.max_position_embeddings,
        tokenizer_file=tokenizer_file,
        tokenizer_model=tokenizer_model,
        skip=no_tokenizer,
    )
    if tokenizer.note:
        log(f"note: {tokenizer.note}")
    token_ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    initializer_range = float(getattr(reader.args, "init_method_std", 0.02))
    if isinstance(layout, MotifLayout):  # Motif's config class is remote code: its keys are written as JSON
        motif_config = motif_config_dict(
            layout,
            dtype=_dtype_name(dtype),
            **token_ids,
            initializer_range=initializer_range,
            head_norm_eps=getattr(reader.args, "head_norm_eps", None),
            source=getattr(reader.args, SOURCE_CONFIG_ARG, None),  # an import's config.json
        )
    else:
        config = transformers_config_class(layout)(
            **hf_config_dict(
                layout,
                dtype=_dtype_name(dtype),
                **token_ids,
                initializer_range=initializer_range,
                lambda_std=float(getattr(reader.args, "lambda_std", 0.1)),
            )
        )
    shapes = hf_model_shapes(layout)
    plan = [(name, shape, hf_export_dtype(layout, name, dtype)) for name, shape in shapes.items()]
    needed = sum(math.prod(shape) * t.itemsize for _, shape, t in plan)
    with atomic_output_dir(save, HF_EXPORT, needed_bytes=needed) as out:
        writer = SafetensorsShardWriter(out, max_shard_size, plan)
        for key in layout.mcore_global_shapes():  # one at a time: the embedding alone is several layers
            (tensor,) = reader.read_globals(layout, [key]).values()
            writer.add({GLOBALS[key]: tensor.to(dtype)})  # tied: no output layer, no lm_head
            del tensor
            release_freed_memory()
        progress = Progress("mcore-to-hf", layout.num_layers)
        for index in range(layout.num_layers):
            hf_layer = mcore_layer_to_hf(reader.read_layer(layout, index), layout, dtype)
            writer.add({HF_LAYER_PREFIX.format(index) + k: v for k, v in hf_layer.items()})
            del hf_layer
            release_freed_memory()
            progress.layer_done(index + 1)
        shards = writer.close()
        if isinstance(layout, MotifLayout):
            write_json(os.path.join(out, "config.json"), motif_config)
        else:
            config.save_pretrained(out)
        save_remote_code(layout, out)
        ids = generation_config_dict(tokenizer.eos_token_id, tokenizer.bos_token_id)
        transformers.GenerationConfig(**ids).save_pretrained(out)
        if tokenizer.fast is not None:
            save_hf_tokenizer(tokenizer.fast, out)
        wrote_tokenizer = tokenizer.copy_files(out) or tokenizer.fast is not None
    summary = (
        f"wrote {save}: {layout.architecture}, {layout.num_layers} layers, {_dtype_name(dtype)}, "
        f"{len(shards)} shard(s), {writer.total_bytes / 1e9:.3f} GB"
        f"{', tokenizer' if wrote_tokenizer else ''} (from {reader.path}) in "
        f"{clock(time.perf_counter() - start)}"
    )
    print(summary, flush=True)
    if kept:  # the folder's own files and folders
        log(f"note: kept {some_names(kept)} in {save} (not an export's files)")
    return summary


def export_command(save: str, target: str, iteration: int) -> str:
    """The command that writes the export by hand (after a skipped or failed end-of-training export)."""
    return (
        f"python tools/convert_checkpoint.py mcore-to-hf --load {shlex.quote(save)} --iteration {iteration} "
        f"--save {shlex.quote(target)} --overwrite"
    )


def export_at_end(
    save: str, target: str, iteration: int, interrupted: bool, log: Callable[[str], None] = stderr
) -> bool:
    """`pretrain_diff.py --export-hf-at-end TARGET`: the run's final checkpoint also as a Hugging Face folder.

    Called on one rank once training has ended and every rank's part of the checkpoint is written (after
    the process group is gone: no rank waits for it). The export replaces an earlier export's files in
    TARGET (others stay), as `mcore-to-hf --overwrite` does; it never writes into --save, so a failure
    (one warning line with the command to repeat it) leaves the checkpoint as it was. Ctrl-C skips it.
    """
    saved = read_tracker(save)
    if interrupted or saved != iteration:
        why = (
            "the run was interrupted"
            if interrupted
            else f"the last complete checkpoint in {save} is {saved}, not the final iteration {iteration}"
        )
        command = export_command(save, target, saved if saved is not None else iteration)
        log(f"warning: --export-hf-at-end skipped ({why}); export by hand: {command}")
        return False
    log(f"exporting iteration {iteration} to {target} (--export-hf-at-end)")
    try:
        export_checkpoint(save, target, iteration=iteration, overwrite=True, log=log)
    except Exception as exc:  # noqa: BLE001 - a failed export must never fail the finished run
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log(
            f"warning: --export-hf-at-end {target} failed ({reason}); checkpoint iteration {iteration} in "
            f"{save} is complete and untouched: {export_command(save, target, iteration)}"
        )
        return False
    return True
