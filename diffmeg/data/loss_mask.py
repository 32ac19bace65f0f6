"""Per-token loss masks: a companion dataset of mask bits, and whole-document training samples.

A token dataset ``{prefix}.bin/.idx`` may carry a loss mask ``{prefix}.loss_mask.bin/.idx``: an indexed
dataset of uint8 bits with exactly the token dataset's sequence lengths and documents, where bit 1 marks
a token the loss is computed on (a target) and 0 a token that is only context. Tasks whose signal is a
few answer tokens among many given ones (associative recall, question answering, instruction data)
need it: averaged over every token, the answers' gradient drowns in that of unpredictable context.

The trainer (``diffmeg.training.data.build_datasets``) detects the companion and then reads the dataset
one document per sample instead of as megatron-core's GPT windows: sample = one whole document, never
part of two, so a mask bit always belongs to its own document's tokens. A document of n <= seq_length + 1
tokens gives inputs ``doc[:-1]``, labels ``doc[1:]`` and loss mask ``mask[1:]`` (the bit of the predicted
token), padded to seq_length with token 0 and mask 0. Documents are assigned to train/valid/test by
``--split`` as megatron-core does (contiguous blocks), and each split's documents are reshuffled every
epoch, deterministically from ``--seed``. Writers commit the mask before the tokens, so a dataset that
looks complete (both token files present) never lacks the mask it was written with.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from diffmeg.data.indexed import (
    IndexedWriter,
    abort_writers,
    check_can_write,
    has_loss_mask,
    loss_mask_prefix,
    remove_stale_temporaries,
)
from diffmeg.data.splits import check_splits_nonempty, split_matrix
from diffmeg.data.tokenizers import check_vocabulary
from diffmeg.errors import DiffmegError

PAD_TOKEN = 0
"""Inputs and labels of positions past a short document's end (their mask bit is 0)."""


class MaskedWriter:
    """Tokens and their loss-mask bits, written as a dataset and its companion, atomically.

    Use as a context manager and call ``commit()`` at the end; leaving early deletes both temporary
    outputs (a full disk becomes one ``DiskFullError`` line). Every document is one sequence (document i
    is ``IndexedDataset[i]``). Temporaries a killed earlier run left for these outputs are removed first.
    """

    def __init__(self, prefix: str, dtype: type[np.number], overwrite: bool = False) -> None:
        check_can_write([prefix, loss_mask_prefix(prefix)], overwrite)
        remove_stale_temporaries([prefix, loss_mask_prefix(prefix)])
        self.prefix = prefix
        self._tokens = IndexedWriter(prefix, dtype=dtype)
        self._mask = IndexedWriter(loss_mask_prefix(prefix), dtype=np.uint8)

    @property
    def documents(self) -> int:
        return self._tokens.documents

    @property
    def tokens(self) -> int:
        return self._tokens.tokens

    def add_documents(self, tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        """Many documents at once: ``tokens`` and ``mask`` concatenated, ``lengths`` per document."""
        if np.shape(tokens) != np.shape(mask):
            raise ValueError(f"tokens {np.shape(tokens)} and mask {np.shape(mask)} differ in shape")
        self._tokens.add_documents(tokens, lengths)
        self._mask.add_documents(np.asarray(mask, dtype=bool).astype(np.uint8), lengths)

    def commit(self) -> None:
        self._mask.commit()  # first: complete-looking tokens must never lack their mask
        self._tokens.commit()

    def abort(self) -> None:
        self._tokens.abort()
        self._mask.abort()

    def __enter__(self) -> MaskedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        directory = os.path.dirname(os.path.abspath(self.prefix))
        abort_writers([self._tokens, self._mask], exc, directory)


class MaskedDocuments:
    """A token dataset and its mask, read document by document (documents may span sequences)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.tokens = IndexedDataset(prefix)
        self.mask = IndexedDataset(loss_mask_prefix(prefix))
        same = np.array_equal(self.tokens.sequence_lengths, self.mask.sequence_lengths) and np.array_equal(
            self.tokens.document_indices, self.mask.document_indices
        )
        if not same:
            raise DiffmegError(
                f"{loss_mask_prefix(prefix)} does not match {prefix} (different sequence lengths or "
                "documents); write the mask with the tokens again (or delete it to train on every token)"
            )
        doc_index = np.asarray(self.tokens.document_indices, dtype=np.int64)
        seq_lengths = np.asarray(self.tokens.sequence_lengths, dtype=np.int64)
        ends = np.concatenate([[0], np.cumsum(seq_lengths)])
        self.lengths = ends[doc_index[1:]] - ends[doc_index[:-1]]
        self._doc_index = doc_index

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens as int64, mask as bool) of document ``index``."""
        seqs = range(self._doc_index[index], self._doc_index[index + 1])
        tokens = [np.asarray(self.tokens[s], dtype=np.int64) for s in seqs]
        mask = [np.asarray(self.mask[s]).astype(bool) for s in seqs]
        if len(tokens) == 1:
            return tokens[0], mask[0]
        return np.concatenate(tokens), np.concatenate(mask)


class LossMaskDataset(torch.utils.data.Dataset):
    """One split's training samples: one whole document each, in a reshuffled order every epoch."""

    def __init__(
        self,
        documents: MaskedDocuments,
        doc_ids: np.ndarray,
        seq_length: int,
        num_samples: int,
        seed: int,
        split_index: int,
    ) -> None:
        if len(doc_ids) == 0:
            raise DiffmegError(f"a split of {documents.prefix} holds no documents; check --split")
        longest = int(documents.lengths[doc_ids].max())
        if longest > seq_length + 1:
            raise DiffmegError(
                f"{documents.prefix} has a document of {longest} tokens; with a loss mask every sample is "
                f"one whole document, so it needs --seq-length >= {longest - 1}"
            )
        self.documents, self.doc_ids, self.seq_length = documents, doc_ids, seq_length
        self.seed, self.split_index = seed, split_index
        self.size = max(num_samples, len(doc_ids))
        self._epoch, self._order = -1, doc_ids

    def __len__(self) -> int:
        return self.size

    def document_index(self, idx: int) -> int:
        """The dataset document that sample ``idx`` reads."""
        epoch, k = divmod(idx, len(self.doc_ids))
        if epoch != self._epoch:
            rng = np.random.default_rng((self.seed, self.split_index, epoch))
            self._epoch, self._order = epoch, rng.permutation(self.doc_ids)
        return int(self._order[k])

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        doc, bits = self.documents.get(self.document_index(idx))
        n = len(doc) - 1
        tokens = np.full(self.seq_length, PAD_TOKEN, dtype=np.int64)
        labels = np.full(self.seq_length, PAD_TOKEN, dtype=np.int64)
        loss_mask = np.zeros(self.seq_length, dtype=np.float32)
        tokens[:n], labels[:n], loss_mask[:n] = doc[:-1], doc[1:], bits[1:]
        return {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }


def check_masked_blend(prefixes: Sequence[str]) -> None:
    """A blend with a loss-masked dataset must be that one dataset alone: its documents are read whole, one
    per sample, and cannot be interleaved with GPT windows or another masked dataset. A no-op otherwise."""
    masked = [p for p in prefixes if has_loss_mask(p)]
    if not masked:
        return
    unmasked = [p for p in prefixes if p not in masked]
    if unmasked:
        raise DiffmegError(
            f"--data-path mixes datasets with and without a loss mask ({unmasked[0]} has none, "
            f"{loss_mask_prefix(masked[0])} exists); train on one kind, or write masks for all"
        )
    if len(prefixes) > 1:
        raise DiffmegError(
            f"--data-path blends {len(prefixes)} loss-masked datasets, which are read one document per "
            "sample and cannot be blended; merge them into one first (tools/merge_datasets.py)"
        )


def build_loss_mask_datasets(
    prefixes: Sequence[str],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    vocab_size: int | None = None,
) -> tuple:
    """(train, valid, test) whole-document datasets of a loss-masked ``--data-path``; None for a split
    of weight 0. ``vocab_size``: the run's embedding rows, which every token id must be below."""
    check_masked_blend(prefixes)
    (prefix,) = prefixes
    if vocab_size is not None:
        check_vocabulary([prefix], vocab_size)
    check_splits_nonempty([prefix], split)
    documents = MaskedDocuments(prefix)
    count = len(documents)
    out = []
    for index, bounds in enumerate(split_matrix(split)):
        if bounds is None:
            out.append(None)
            continue
        beg, end = int(round(bounds[0] * count)), int(round(bounds[1] * count))
        doc_ids = np.arange(beg, end, dtype=np.int64)
        out.append(LossMaskDataset(documents, doc_ids, seq_length, num_samples[index], seed, index))
    return tuple(out)
