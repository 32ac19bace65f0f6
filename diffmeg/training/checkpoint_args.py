"""`--use-checkpoint-args` (Megatron-LM's flag): a run's model shape and tokenizer from the checkpoint it
starts from, so a model with no preset (an upcycled or imported Llama) needs no shape flags.

The checkpoint is `--load`'s latest when it holds one (a resumed run), else `--pretrained-checkpoint`'s
latest. Its args.json gives the fields below; they sit where a `--model` preset's values sit (flags typed
on the command line still win).
"""

from __future__ import annotations

import os
from collections.abc import Collection

from diffmeg.checkpoints import read_checkpoint_args, read_tracker
from diffmeg.errors import DiffmegError
from diffmeg.run_config import SHAPE_FIELDS

MODEL_ARGS = (
    *SHAPE_FIELDS,
    "group_query_attention",
    "seq_length",
    "max_position_embeddings",
    "rotary_base",
    "norm_epsilon",
    "lambda_init",
    "tie_embeddings_and_output_weights",
    "tokenizer_type",
    "tokenizer_model",
)
"""What `--use-checkpoint-args` takes from a checkpoint: the model's shape and its tokenizer (seq_length as
a default for the run's own)."""


def checkpoint_model_args(
    load: str | None, pretrained: str | None, typed: Collection[str] = ()
) -> dict[str, object]:
    """The MODEL_ARGS of the checkpoint a run with these `--load` / `--pretrained-checkpoint` starts from.

    `typed`: the flags given on the command line (they win); a typed `--tokenizer-type` also drops the
    checkpoint's tokenizer folder, so the run is checked against the checkpoint as the user asked."""
    for root in (load, pretrained):
        if root is not None and os.path.isdir(root) and read_tracker(root) is not None:
            args, _ = read_checkpoint_args(root)
            values = vars(args)
            names = [n for n in MODEL_ARGS if not (n == "tokenizer_model" and "tokenizer_type" in typed)]
            return {name: values[name] for name in names if name in values}
    raise DiffmegError(
        "--use-checkpoint-args needs a checkpoint to read: --load or --pretrained-checkpoint holding one "
        f"(latest_checkpointed_iteration.txt); got --load {load}, --pretrained-checkpoint {pretrained}"
    )
