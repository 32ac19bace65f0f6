"""Any model source a tool may name: a pretrain_diff.py checkpoint or a Hugging Face DiffLlama / Llama folder.

Stands above both `diffmeg.checkpoints` (the checkpoint directory on disk) and `diffmeg.conversion` (the
Hugging Face importer), so neither needs the other: `is_hf_folder` tells the two kinds apart from what the
directory holds, `read_checkpoint_info` reads what a source is without its weights, and
`load_checkpoint_model` builds the single-rank model of either, the same way.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from diffmeg import checkpoints
from diffmeg.conversion.hf_import import CONFIG_FILE, analysis_args, load_hf_model, open_hf_folder
from diffmeg.errors import DiffmegError


def is_hf_folder(path: str) -> bool:
    """A directory with config.json and no pretrain_diff.py checkpoint tracker."""
    return os.path.isfile(os.path.join(path, CONFIG_FILE)) and not os.path.isfile(
        os.path.join(path, checkpoints.TRACKER_FILE)
    )


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
        """The vocabulary its token ids mean: "mock" (mock data and `--tokenizer-type null` ids),
        "HuggingFaceTokenizer" (a model's own, `args["tokenizer_model"]`) or "cl100k_base"."""
        if self.args.get("mock_data") or self.args.get("tokenizer_type") == "null":
            return "mock"
        hf = self.args.get("tokenizer_type") == "HuggingFaceTokenizer"
        return "HuggingFaceTokenizer" if hf else "cl100k_base"

    def identity(self) -> dict:
        """Which checkpoint a result is of: the first fields of every evaluation's per-checkpoint record."""
        fields = {"label": self.label, "load": self.root, "iteration": self.iteration}
        return fields | {"architecture": self.architecture}


def read_checkpoint_info(root: str, iteration: int | None = None) -> CheckpointInfo:
    """The arguments a checkpoint was trained with (cheap: no weights are read).

    A folder with config.json (a Hugging Face DiffLlama / Llama) is accepted too: its arguments come
    from config.json (seq_length = max_position_embeddings; tokenizer cl100k_base when the vocabulary
    holds cl100k's ids, else mock), its tensors are checked from the safetensors headers only.
    """
    if not os.path.isdir(root):
        raise DiffmegError(f"--load {root} is not a directory")
    if is_hf_folder(root):
        if iteration is not None:
            raise DiffmegError(
                f"--iteration {iteration} does not apply to {root}: a Hugging Face folder holds one model"
            )
        args = analysis_args(open_hf_folder(root))
        return CheckpointInfo(root=root, iteration=None, path=root, args=vars(args), hf=True)
    args, path = checkpoints.read_checkpoint_args(root, iteration)
    resolved = int(os.path.basename(path).removeprefix("iter_"))
    return CheckpointInfo(root=root, iteration=resolved, path=path, args=vars(args))


def load_checkpoint_model(info: CheckpointInfo, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The single-rank model of a checkpoint or Hugging Face folder, in eval mode and `dtype`.

    Needs `diffmeg.runtime.single_process()`. Both are built the same way (fp32, then cast), so a
    Hugging Face export of a checkpoint gives the checkpoint's numbers.
    """
    if info.hf:
        return load_hf_model(open_hf_folder(info.root), argparse.Namespace(**info.args), dtype)
    model, _ = checkpoints.load_model_weights(info.root, info.iteration, dtype=dtype)
    return model
