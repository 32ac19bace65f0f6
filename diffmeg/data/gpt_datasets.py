"""Training data: ``--data-path`` blends -> megatron-core GPTDatasets (train, valid, test).

The sample order is megatron-core's: document, sample and shuffle indices drawn from ``seed``
(and, for blends, BlendedDataset's deterministic interleaving by weight), cached in the folder
`diffmeg.data.index_cache` resolves (``--data-cache-path``, else beside the data, else per user). Sample k
is therefore the same in every run with the same data, split, sequence length, seed and sample counts, and
resuming after ``consumed_samples`` is exact.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

from diffmeg.collectives import on_rank0
from diffmeg.data.builtin import builtin_corpus
from diffmeg.data.index_cache import (
    in_folder,
    megatron_prefixes,
    resolve_cache_path,
    unreadable_cache,
    unwritable_cache,
)
from diffmeg.data.indexed import check_dataset
from diffmeg.data.loss_mask import check_masked_blend
from diffmeg.data.splits import check_splits_nonempty
from diffmeg.data.tokenizers import check_datasets, check_vocabulary, record_of
from diffmeg.errors import DiffmegError, stderr

BUILTIN = "builtin"
"""``--data-path builtin``: the corpus generated from Python's own documentation (data/builtin.py)."""
SINGLE_BLEND_WARNING = "Building a BlendedDataset for a single MegatronDataset"


class _SingleDatasetBlend(logging.Filter):
    """Drops megatron-core's warning for a blend of one weighted dataset (``--data-path 1 PREFIX``, e.g. a
    length-upsample weights file of one bucket), once per split: the blend is valid and its sample order
    is that of the run that wrote it, so dropping the weight would change a resumed run's samples."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != SINGLE_BLEND_WARNING


logging.getLogger("megatron.core.datasets.blended_dataset").addFilter(_SingleDatasetBlend())


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
        try:
            check_dataset(prefix)  # a truncated .bin or a damaged .idx: one line now, not a crash later
        except DiffmegError as exc:
            raise DiffmegError(f"--data-path {prefix}: {exc}") from None
        return
    hint = ""
    if prefix.endswith((".bin", ".idx")):
        hint = f" (give the prefix without the extension: {prefix[:-4]})"
    elif os.path.isfile(prefix + "_text_document.idx"):
        hint = f" (did you mean {prefix}_text_document?)"
    raise DiffmegError(f"--data-path {prefix}: missing {' and '.join(missing)}{hint}")


def check_blend(prefixes: Sequence[str], split: str) -> dict[str, list[int | None]]:
    """What a run refuses of its blend and ``--split`` before it builds a dataset: a loss-masked dataset in a
    blend, and a split that leaves a dataset's train, valid or test part without tokens. The one function the
    run (`diffmeg.training.data.build_datasets`, `build_gpt_datasets`) and ``--dry-run`` call, so a dry run
    refuses what the run would, in the same line. Returns each dataset's documents per split; ``builtin``
    is checked once it is built."""
    prefixes = [p for p in prefixes if p != BUILTIN]
    check_masked_blend(prefixes)
    return check_splits_nonempty(prefixes, split)


def build_gpt_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    tokenizer,
    cache_path: str | None,
    is_built_on_rank: Callable[[], bool] | None = None,
    vocab_size: int | None = None,
) -> tuple:
    """(train, valid, test) GPTDatasets, or BlendedDatasets for a weighted ``--data-path``.

    Call on every rank after ``torch.distributed.init_process_group``: megatron-core builds the
    index caches on rank 0 first and then the other ranks read them (BlendedDataset requires the
    process group even on one rank). ``cache_path`` is ``--data-cache-path``; None: ``cache/`` beside the
    first dataset, or the per-user cache where that cannot be written (`resolve_cache_path`, decided on
    rank 0 for every rank, its one line printed there). A split whose weight is
    0 comes back as None. ``is_built_on_rank`` defaults to every rank building its own datasets.
    ``vocab_size``: the run's embedding rows; every dataset's ids must be below it (`check_vocabulary`).
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError("build_gpt_datasets needs torch.distributed initialised (gloo is fine on CPU)")
    prefixes, weights = parse_data_path(data_path)
    if BUILTIN in prefixes:
        builtin = builtin_corpus(tokenizer=tokenizer)
        prefixes = [builtin if p == BUILTIN else p for p in prefixes]
    if tokenizer is not None:  # ids made with another vocabulary would train silently on wrong tokens
        check_datasets(prefixes, record_of(tokenizer))
    if vocab_size is not None:  # an id past the embedding is an index error inside the first step
        check_vocabulary(prefixes, vocab_size, cache_path, collective=True)  # every rank is here
    check_blend(prefixes, split)
    cache, note = on_rank0(lambda: resolve_cache_path(prefixes, cache_path))  # the same folder on every rank
    if note and torch.distributed.get_rank() == 0:
        stderr(note)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(megatron_prefixes(prefixes), weights),
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=cache,
    )
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset, list(num_samples), is_built_on_rank or (lambda: True), config
    )
    rank = torch.distributed.get_rank()
    try:
        train, valid, test = builder.build()
    except FileNotFoundError as exc:  # rank 0 wrote the indices where this rank cannot see them
        if rank == 0 or not in_folder(str(exc.filename or ""), cache):
            raise
        raise unreadable_cache(cache, rank, exc.filename) from None
    except Exception as exc:  # megatron-core's wrapping of a failed write (a full disk, a quota)
        if not isinstance(exc.__cause__, OSError) or "data cache directory" not in str(exc):
            raise
        raise unwritable_cache(cache, exc.__cause__) from None
    return train, valid, test


EPOCH_NOTE_MARGIN = 0.01
"""A train split exceeded by less than this share is noted: a second epoch indexed for a sliver of it."""


def epoch_note(train, train_iters: int) -> str | None:
    """One line when a dataset's train split is exceeded by under `EPOCH_NOTE_MARGIN` (megatron-core then
    indexes a second epoch, silently: 487M samples for 244M at 1T tokens), naming the `--train-iters`
    that stays in one epoch; None otherwise. `train`: a GPTDataset, or a BlendedDataset of them."""
    for dataset in getattr(train, "datasets", [train]):
        if not isinstance(dataset, GPTDataset) or not dataset.num_samples:
            continue
        extra = int(dataset.config.add_extra_token_to_sequence)
        tokens = int(dataset.dataset.sequence_lengths[dataset.indices].sum())  # the split's epoch
        per_epoch = (tokens - extra) // dataset.config.sequence_length
        asked = dataset.num_samples
        if per_epoch < asked <= per_epoch * (1 + EPOCH_NOTE_MARGIN):
            iters = train_iters * per_epoch // asked
            return (
                f"note: {dataset.dataset.path_prefix}'s train split holds {per_epoch:,} samples and the run "
                f"asks {asked:,}: 2 epochs are indexed for {100 * (asked / per_epoch - 1):.2f}% more; "
                f"--train-iters {iters} stays in one epoch"
            )
    return None
