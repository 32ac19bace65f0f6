"""``--split``: megatron-core's assignment of a dataset's documents to train/valid/test, checked before use.

Shared by both dataset builders (megatron-core's GPT windows in `gpt_datasets`, whole loss-masked documents
in `loss_mask`): each split with a nonzero weight gets the contiguous block of documents megatron-core
gives it, and a split left without tokens is refused in one line before megatron-core would loop on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.indexed_dataset import _IndexReader, get_idx_path

from diffmeg.errors import DiffmegError

_SPLIT_NAMES = ("train", "valid", "test")


def check_splits_nonempty(prefixes: Sequence[str], split: str) -> dict[str, list[int | None]]:
    """Every split with nonzero weight must get at least one document with tokens, per prefix.

    megatron-core loops forever (GPTDataset._get_num_epochs) on a split without tokens, so this
    reproduces its document assignment (round(fraction * count) bookends) and fails first. Returns each
    prefix's documents per split (train, valid, test; None for a split of weight 0), for --dry-run.
    """
    bookends = split_matrix(split)  # validates the string
    documents: dict[str, list[int | None]] = {}
    for prefix in prefixes:
        index = _IndexReader(get_idx_path(prefix), multimodal=False)
        lengths = np.array(index.sequence_lengths)  # a copy: the reader unmaps its file when freed
        del index
        if int(lengths.sum(dtype=np.int64)) == 0:
            raise DiffmegError(
                f"--data-path {prefix} holds no tokens ({len(lengths)} documents); check the data"
            )
        empty = _empty_splits(lengths, split)
        if empty:
            name, what = empty[0]
            raise DiffmegError(
                f"--split {split} gives the {name} split of {prefix} {what} (it has {len(lengths)} "
                f"documents); use more data or a split such as '{_suggest(lengths, split)}'"
            )
        count = len(lengths)
        documents[prefix] = [
            None if b is None else int(round(b[1] * count)) - int(round(b[0] * count)) for b in bookends
        ]
    return documents


def _empty_splits(lengths: np.ndarray, split: str) -> list[tuple[str, str]]:
    count, empty = len(lengths), []
    for name, bounds in zip(_SPLIT_NAMES, split_matrix(split), strict=True):
        if bounds is None:
            continue
        beg, end = int(round(bounds[0] * count)), int(round(bounds[1] * count))
        if end <= beg:
            empty.append((name, "no documents"))
        elif int(lengths[beg:end].sum(dtype=np.int64)) == 0:
            empty.append((name, f"{end - beg} documents but no tokens"))
    return empty


def _suggest(lengths: np.ndarray, split: str) -> str:
    """The given split with the splits that come out empty set to 0 (repeated until none do)."""
    values = ([float(p) for p in split.split(",")] + [0.0, 0.0])[:3]
    while True:
        if not any(values):
            return "1,0,0"
        text = ",".join(f"{v:g}" for v in values)
        empty = [_SPLIT_NAMES.index(name) for name, _ in _empty_splits(lengths, text)]
        if not empty or all(values[i] == 0 for i in empty):
            return text
        for i in empty:
            values[i] = 0.0


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """megatron-core's split bookends for ``--split`` (e.g. "969,30,1"), with a clear error."""
    parts = [p.strip() for p in split.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise DiffmegError(
            f"--split {split!r} must be 1-3 comma-separated non-negative weights, e.g. 969,30,1"
        )
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
