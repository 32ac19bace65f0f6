"""A model's tokenizer across the conversions: brought in from a Hugging Face folder (hf-to-mcore, upcycle)
and written out with an export (mcore-to-hf).

In: a model keeps its vocabulary, so a checkpoint made from a folder keeps the folder's tokenizer: its
files are copied byte for byte into `{checkpoint}/tokenizer/` and args.json records `--tokenizer-type
HuggingFaceTokenizer --tokenizer-model tokenizer` (relative to the checkpoint folder, which readers
resolve: the folder can move; with its vocabulary's fingerprint), which training checks its flags and data
against. A folder holding diffmeg's own cl100k_base export records cl100k_base (the same ids); a folder
without tokenizer files records nothing (cl100k_base, as before).

Out: a checkpoint trained with a Hugging Face tokenizer exports that tokenizer's files unchanged (and its
bos / eos ids); a cl100k_base checkpoint gets diffmeg's fast cl100k_base tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diffmeg.checkpoints import TOKENIZER_DIR
from diffmeg.data.hf_tokenizer import HF_TOKENIZER, HFTokenizer, copy_tokenizer_files, has_tokenizer_files
from diffmeg.errors import DiffmegError


@dataclass(frozen=True)
class FolderTokenizer:
    """What a checkpoint made from a folder records about its tokenizer."""

    source: str | None
    """The folder whose tokenizer files go into `{checkpoint}/tokenizer` (None: nothing to copy)."""
    fingerprint: str | None = None

    def flags(self) -> list[str]:
        """pretrain_diff.py flags that resolve to this tokenizer now (they name the source folder; the
        checkpoint then records its own copy, `record`)."""
        if self.source is None:
            return []
        return ["--tokenizer-type", HF_TOKENIZER, "--tokenizer-model", self.source]

    def record(self, args) -> None:
        """Point resolved arguments at the checkpoint's own copy of the tokenizer, by its path relative to
        the checkpoint folder (`diffmeg.checkpoints.read_checkpoint_args` makes it absolute where it lies)."""
        if self.source is not None:
            args.tokenizer_model = TOKENIZER_DIR

    def copy_into(self, directory: str) -> list[str]:
        """Copy the tokenizer files into `directory/tokenizer` (the checkpoint being written)."""
        if self.source is None:
            return []
        return copy_tokenizer_files(self.source, os.path.join(directory, TOKENIZER_DIR))


def folder_tokenizer(directory: str) -> FolderTokenizer:
    """The tokenizer of a Hugging Face folder, or of a checkpoint's recorded tokenizer folder."""
    from diffmeg.data.tokenizers import CL100K, record_of

    if not has_tokenizer_files(directory):
        return FolderTokenizer(None)
    tokenizer = HFTokenizer(directory)
    record = record_of(tokenizer)
    if record.type == CL100K:  # diffmeg's cl100k_base export: cl100k_base's ids
        return FolderTokenizer(None)
    return FolderTokenizer(tokenizer.source, record.fingerprint)


@dataclass(frozen=True)
class ExportTokenizer:
    """The tokenizer an export writes, and the bos / eos ids of its config.json and generation_config.json."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    files_from: str | None = None
    """A Hugging Face tokenizer folder whose files are copied unchanged."""
    fast: Any = None
    """diffmeg's cl100k_base as a fast tokenizer (`save_hf_tokenizer` writes it)."""
    note: str | None = None
    """Why no tokenizer is written (for stderr)."""

    def copy_files(self, directory: str) -> bool:
        """Copy a Hugging Face tokenizer's files into the export; False when it has none (the fast
        cl100k_base tokenizer is written with `checkpoint_io.save_hf_tokenizer`)."""
        if self.files_from is None:
            return False
        copy_tokenizer_files(self.files_from, directory)
        return True


def export_tokenizer(
    ckpt_args: Mapping[str, Any],
    vocab_size: int,
    max_positions: int,
    *,
    tokenizer_file: str | None = None,
    tokenizer_model: str | None = None,
    skip: bool = False,
) -> ExportTokenizer:
    """The tokenizer to export with a checkpoint: its Hugging Face tokenizer folder (`tokenizer_model`, else
    the one args.json records), else cl100k_base when the vocabulary holds cl100k's ids (`tokenizer_file`,
    else the recorded / environment's BPE file), else none."""
    from diffmeg.data.tiktoken_cl100k import CL100K_N_VOCAB, EOD_ID, load_tokenizer

    hf = tokenizer_model is not None or ckpt_args.get("tokenizer_type") == HF_TOKENIZER
    if skip:  # no files; cl100k_base's ids still name <|endoftext|> in the configs
        eod = EOD_ID if not hf and vocab_size >= CL100K_N_VOCAB else None
        return ExportTokenizer(eod, eod)
    if hf:
        folder = tokenizer_model or ckpt_args.get("tokenizer_model")
        if not folder or not has_tokenizer_files(folder):
            raise DiffmegError(
                f"the checkpoint was trained with the Hugging Face tokenizer {folder}, which holds no "
                f"tokenizer files now; pass --tokenizer-model with that tokenizer's folder, or --no-tokenizer"
            )
        tokenizer = HFTokenizer(folder)
        return ExportTokenizer(tokenizer.bos, tokenizer.eod, files_from=tokenizer.source)
    if vocab_size < CL100K_N_VOCAB:
        return ExportTokenizer(
            note=f"vocabulary {vocab_size} < cl100k_base's {CL100K_N_VOCAB} (a mock-data model): "
            f"writing no tokenizer"
        )
    from diffmeg.conversion.tokenizer_export import build_fast_tokenizer

    cl100k = load_tokenizer(tokenizer_file or ckpt_args.get("tokenizer_file"))
    fast = build_fast_tokenizer(cl100k.encoding, model_max_length=max_positions)
    return ExportTokenizer(EOD_ID, EOD_ID, fast=fast)
