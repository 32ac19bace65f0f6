"""Training data: ``--data-path`` blends -> megatron-core GPTDatasets (train, valid, test).

The sample order is megatron-core's: document, sample and shuffle indices drawn from ``seed``
(and, for blends, BlendedDataset's deterministic interleaving by weight), cached under
``--data-cache-path``. Sample k is therefore the same in every run with the same data, split,
sequence length, seed and sample counts, and resuming after ``consumed_samples`` is exact.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import _IndexReader, get_bin_path, get_idx_path

from diffmeg.errors import DiffmegError

BUILTIN = "builtin"
"""``--data-path builtin``: the corpus generated from Python's own documentation (data/builtin.py)."""
_SPLIT_NAMES = ("train", "valid", "test")


def parse_data_path(values: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: one prefix, or ``w1 p1 w2 p2 ...`` (weights need not sum to 1).

    Checks that every prefix has its ``.bin`` and ``.idx`` (``builtin`` is built on first use).
    """
    values = list(values)
    if not values:
        raise DiffmegError("--data-path is empty: give a dataset prefix or 'w1 p1 w2 p2 ...'")
    if len(values) == 1:
        prefixes, weights = values, None
    else:
        if len(values) % 2:
            raise DiffmegError(
                f"--data-path has {len(values)} values; a blend is weight/prefix pairs 'w1 p1 w2 p2 ...'"
            )
        prefixes, weights = values[1::2], []
        for raw in values[0::2]:
            try:
                weight = float(raw)
            except ValueError:
                raise DiffmegError(
                    f"--data-path weight {raw!r} is not a number; a blend is 'w1 p1 w2 p2 ...'"
                ) from None
            if not math.isfinite(weight) or weight <= 0:
                raise DiffmegError(f"--data-path weight {raw} must be > 0 (leave the dataset out instead)")
            weights.append(weight)
    for prefix in prefixes:
        if prefix != BUILTIN:
            _check_prefix(prefix)
    return prefixes, weights


def _check_prefix(prefix: str) -> None:
    missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not os.path.isfile(p)]
    if not missing:
        return
    hint = ""
    if prefix.endswith((".bin", ".idx")):
        hint = f" (give the prefix without the extension: {prefix[:-4]})"
    elif os.path.isfile(prefix + "_text_document.idx"):
        hint = f" (did you mean {prefix}_text_document?)"
    raise DiffmegError(f"--data-path {prefix}: missing {' and '.join(missing)}{hint}")


def check_splits_nonempty(prefixes: Sequence[str], split: str) -> None:
    """Every split with nonzero weight must get at least one document with tokens, per prefix.

    megatron-core loops forever (GPTDataset._get_num_epochs) on a split without tokens, so this
    reproduces its document assignment (round(fraction * count) bookends) and fails first.
    """
    split_matrix(split)  # validates the string
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


def build_gpt_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    tokenizer,
    cache_path: str | None,
    is_built_on_rank: Callable[[], bool] | None = None,
) -> tuple:
    """(train, valid, test) GPTDatasets, or BlendedDatasets for a weighted ``--data-path``.

    Call on every rank after ``torch.distributed.init_process_group``: megatron-core builds the
    index caches on rank 0 first and then the other ranks read them (BlendedDataset requires the
    process group even on one rank). ``cache_path`` is ``--data-cache-path``; None keeps
    megatron-core's default, a ``cache/`` directory next to each dataset. A split whose weight is
    0 comes back as None. ``is_built_on_rank`` defaults to every rank building its own datasets.
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError("build_gpt_datasets needs torch.distributed initialised (gloo is fine on CPU)")
    prefixes, weights = parse_data_path(data_path)
    if BUILTIN in prefixes:
        from diffmeg.data.builtin import builtin_corpus

        builtin = builtin_corpus(tokenizer=tokenizer)
        prefixes = [builtin if p == BUILTIN else p for p in prefixes]
    if tokenizer is not None:  # ids made with another vocabulary would train silently on wrong tokens
        from diffmeg.data.tokenizers import check_datasets, record_of

        check_datasets(prefixes, record_of(tokenizer))
    check_splits_nonempty(prefixes, split)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=cache_path,
    )
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset, list(num_samples), is_built_on_rank or (lambda: True), config
    )
    train, valid, test = builder.build()
    return train, valid, test
