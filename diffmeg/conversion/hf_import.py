"""A Hugging Face DiffLlama / Llama / DIFF V2 / Motif folder as our model, without writing a checkpoint.

`open_hf_folder` reads config.json and the safetensors headers (no weights) and refuses what our model
cannot express; `resolved_pretrain_args` gives the arguments a `pretrain_diff.py` run of that model would
resolve (what an import records in args.json, and what the analysis tools read as the checkpoint's
arguments); `load_hf_model` builds the TP=PP=1 model and maps the weights in, one layer at a time.
Used by `tools/convert_checkpoint.py hf-to-mcore` and by `diffmeg.model_source` (every evaluation tool).
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffmeg.conversion.checkpoint_io import HFCheckpointReader
from diffmeg.conversion.hf_config import (
    SOURCE_CONFIG_ARG,
    layout_from_args,
    layout_from_hf_config,
    pretrain_flags,
)
from diffmeg.conversion.layout import GLOBALS, ModelLayout, MotifLayout
from diffmeg.conversion.mapping import (
    HF_LAYER_PREFIX,
    MCORE_LAYER_PREFIX,
    check_shapes,
    hf_layer_to_mcore,
    hf_model_shapes,
)
from diffmeg.errors import DiffmegError

CONFIG_FILE = "config.json"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer older transformers saved; recomputed, not weights


@dataclass
class HFModelFolder:
    """A checked Hugging Face folder: its reader, transformers-normalised config and our layout."""

    reader: HFCheckpointReader
    config: dict[str, Any]
    layout: ModelLayout

    @property
    def directory(self) -> str:
        return self.reader.directory

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights are stored in (the embedding's)."""
        return self.reader.dtype_of("model.embed_tokens.weight")

    def mcore_blocks(self, dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """TP=1 megatron-core state-dict entries, read lazily: each tensor outside the layers on its own
        (the embedding alone is as large as several layers), then one layer at a time."""
        layout, reader = self.layout, self.reader
        # Nothing is kept between blocks: each is dropped here before the next is read.
        for mcore_name in layout.mcore_global_shapes():  # shapes were checked from the headers
            hf_name = GLOBALS[mcore_name]  # tied: no output layer, the embedding serves as one
            block = {mcore_name: reader.get([hf_name])[hf_name]}
            if dtype is not None:
                block[mcore_name] = block[mcore_name].to(dtype)
            yield block
            del block
        for index in range(layout.num_layers):
            prefix = HF_LAYER_PREFIX.format(index)
            layer = reader.get(prefix + k for k in layout.hf_layer_shapes())
            mcore = hf_layer_to_mcore({k[len(prefix) :]: v for k, v in layer.items()}, layout, dtype)
            del layer
            block = {MCORE_LAYER_PREFIX.format(index) + k: v for k, v in mcore.items()}
            del mcore
            yield block
            del block


def open_hf_folder(directory: str, config: dict[str, Any] | None = None) -> HFModelFolder:
    """Read config.json and the tensor headers; refuse a folder whose weights do not fit its config.

    `config`: the folder's config already normalised by the caller (upcycling reads Mistral as Llama)."""
    reader = HFCheckpointReader(directory)
    config = reader.normalized_config() if config is None else config
    layout = layout_from_hf_config(config)
    stored = reader.shapes()
    expected = hf_model_shapes(layout)
    check_shapes(stored, expected, directory)
    # A tied folder may store lm_head anyway; transformers ties it to the embedding, and so does our model.
    ignored = {"lm_head.weight"} if layout.tied else set()
    extra = sorted(
        n for n in stored if n not in expected and n not in ignored and not n.endswith(_IGNORED_SUFFIXES)
    )
    if extra:
        raise DiffmegError(
            f"{directory}: config.json has model_type {layout.model_type!r} but the weights hold "
            f"{len(extra)} tensor(s) a {layout.hf_name} model does not have (first: {extra[0]!r})"
        )
    return HFModelFolder(reader, config, layout)


def resolved_pretrain_args(
    layout: ModelLayout,
    hf_config: dict[str, Any],
    extra: Sequence[str] = (),
    *,
    seq_length: int | None = None,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
) -> argparse.Namespace:
    """The arguments a `pretrain_diff.py` run of this model would resolve (what args.json records).

    `extra`: further pretrain_diff.py flags (never the model's shape, which comes from config.json).
    Training-only values not given (`--lr`, `--train-iters`) are recorded as 0: a continuing run gives
    its own. `seq_length` defaults to max_position_embeddings. A Motif folder's config.json is kept as it
    is under `SOURCE_CONFIG_ARG` (its export writes back the keys we do not read).
    """
    from diffmeg.model import transformer_config
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import resolve_args

    seq = seq_length or layout.max_position_embeddings
    model_flags = pretrain_flags(layout)
    given = {flag.split("=", 1)[0] for flag in extra if flag.startswith("--")}
    clash = sorted(given & ({f for f in model_flags if f.startswith("--")} | {"--model"}))
    if clash:
        raise DiffmegError(f"{', '.join(clash)} come(s) from config.json; do not pass them after `--`")
    argv = [
        *model_flags,
        "--seq-length", str(seq),
        "--init-method-std", repr(float(hf_config.get("initializer_range", 0.02))),
        "--tensor-model-parallel-size", str(tensor_model_parallel_size),
        "--pipeline-model-parallel-size", str(pipeline_model_parallel_size),
    ]  # fmt: skip
    if "lambda_std_dev" in hf_config:
        argv += ["--lambda-std", repr(float(hf_config.get("lambda_std_dev") or 0.1))]
    if "--lr" not in given:
        argv += ["--lr", "0.0"]
    if "--train-iters" not in given and "--train-tokens" not in given:
        argv += ["--train-iters", "0"]
    try:
        # Validate the layout the checkpoint is recorded for, not the one this process runs in.
        resolved = resolve_args(
            [*argv, *extra],
            world_size=tensor_model_parallel_size * pipeline_model_parallel_size,
            placeholders=True,
        )
    except SystemExit as exc:  # argparse already printed what was wrong with the extra flags
        raise DiffmegError(f"invalid pretrain_diff.py flags after `--`: {shlex.join(extra)}") from exc
    transformer_config(RunConfig.from_args(resolved))  # the TP/PP split of heads, as pretrain_diff.py would
    try:
        same = layout_from_args(resolved) == layout
    except DiffmegError:  # the flags asked for a model no Hugging Face format holds (V1 with noise heads)
        same = False
    if not same:
        raise DiffmegError("the flags after `--` change the model's shape; drop them")
    if isinstance(layout, MotifLayout):  # its keys we do not read come back with the export
        setattr(resolved, SOURCE_CONFIG_ARG, dict(hf_config))
    return resolved


EXAMPLE_TRAINING = {"--lr": "3e-5", "--train-iters": "1000"}
"""What the printed continue-training command trains with where the import was given no `--lr` / no
`--train-iters` or `--train-tokens` after `--` (pretrain_diff.py requires both; an example, the docs' own)."""


def continue_training_command(
    layout: ModelLayout, resolved: argparse.Namespace, checkpoint: str, extra: Sequence[str] = ()
) -> str:
    """The `pretrain_diff.py` command that fine-tunes an import, runnable as printed: the model's flags
    (PolyNorm and Motif's lambda_init included), the checkpoint's own copy of the folder's tokenizer, the
    flags given after `--`, and --lr / --train-iters (example values where none were given); the data
    defaults to the builtin corpus."""
    from diffmeg.checkpoints import TOKENIZER_DIR
    from diffmeg.data.hf_tokenizer import HF_TOKENIZER

    flags = [*pretrain_flags(layout), "--seq-length", str(resolved.seq_length)]
    given = {flag.split("=", 1)[0] for flag in extra if flag.startswith("--")}
    if resolved.tokenizer_type == HF_TOKENIZER and "--tokenizer-model" not in given:
        flags += [
            "--tokenizer-type",
            HF_TOKENIZER,
            "--tokenizer-model",
            os.path.join(checkpoint, TOKENIZER_DIR),
        ]
    flags += ["--load", checkpoint, "--finetune", *extra]
    if "--lr" not in given:
        flags += ["--lr", EXAMPLE_TRAINING["--lr"]]
    if not given & {"--train-iters", "--train-tokens"}:
        flags += ["--train-iters", EXAMPLE_TRAINING["--train-iters"]]
    return f"python pretrain_diff.py {shlex.join(flags)}"


def analysis_args(folder: HFModelFolder, seq_length: int | None = None) -> argparse.Namespace:
    """A folder's arguments as the evaluation and analysis tools read a checkpoint's: resolved as an
    import would record them, with the folder's own tokenizer when it has one (not diffmeg's cl100k_base
    export), else `tokenizer_type` cl100k_base when the vocabulary holds cl100k's ids, else "null" (ids
    of no tokenizer)."""
    from diffmeg.conversion.tokenizer_io import folder_tokenizer
    from diffmeg.data.tiktoken_cl100k import CL100K_N_VOCAB

    tokenizer = folder_tokenizer(folder.directory)
    args = resolved_pretrain_args(folder.layout, folder.config, tokenizer.flags(), seq_length=seq_length)
    if tokenizer.source is None:
        args.tokenizer_type = "cl100k_base" if folder.layout.vocab_size >= CL100K_N_VOCAB else "null"
    args.hf_model_type = folder.layout.model_type
    return args


@torch.no_grad()
def load_hf_model(
    folder: HFModelFolder, args: argparse.Namespace, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The single-rank model of `args` with the folder's weights, in eval mode and `dtype`.

    Built in fp32, filled layer by layer, then cast, exactly as `load_model_weights` builds a checkpoint's
    model (so an export and its source give the same numbers). Needs torch.distributed and megatron-core's
    TP=PP=1 state.
    """
    from diffmeg.checkpoints import build_single_rank_model
    from diffmeg.conversion.checkpoint_io import fill_model

    model = build_single_rank_model(args, torch.float32)
    fill_model(model, folder.mcore_blocks(torch.float32))
    return model.to(dtype).eval()
