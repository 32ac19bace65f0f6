"""Multi-query associative recall (MQAR, as in the Zoology benchmark) as a loss-masked token dataset.

A document is a context of ``num_pairs`` key-value pairs, then ``num_queries`` of the keys again in
random order, each followed by its value:

    k1 v1 [d d] k2 v2 [d] ... kN vN [d d d]  |  k7 v7  k2 v2  ...

The model must predict every queried key's value, so the loss mask (``diffmeg.data.loss_mask``) marks
exactly the query values; everything else is context. Keys come from ids ``[1, V/2)`` and values from
``[V/2, V)`` of a vocabulary of V ids (0 is left for padding); keys are distinct within a document, and
so are values. Difficulty has two axes: more pairs (longer contexts, more candidates to retrieve from),
and distractor tokens between the pairs: ``distractors * num_pairs`` ids drawn from the key half (never
one of the document's own keys, so every query has one answer), spread at random over the gaps after
each pair. Distractors look like keys, so attention that is not sharp on the queried key spreads its
mass over them: the noise the DIFF paper says differential attention cancels. All documents of a
setting have the same length, ``num_pairs * (2 + distractors) + 2 * num_queries`` tokens, and train at
``--seq-length`` one less (``MQARSetting.seq_length``).

Document i of seed s is drawn from ``numpy.random.default_rng((SEED_TAG, s, i))``: held-out sets from
other seeds share no random stream with the training set.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from diffmeg.data.indexed import loss_mask_prefix
from diffmeg.data.loss_mask import MaskedWriter
from diffmeg.errors import DiffmegError
from diffmeg.storage import write_json

SEED_TAG = 0x4D514152
"""Mixed into every document's seed ("MQAR"), so these streams differ from other generators'."""
METADATA_SUFFIX = ".mqar.json"
"""PREFIX.mqar.json records the setting a dataset was generated with (read by the evaluation)."""


@dataclass(frozen=True)
class MQARSetting:
    """One difficulty setting: the shape of every document."""

    num_pairs: int
    """Key-value pairs in the context."""
    num_queries: int | None = None
    """Keys queried after the context (distinct; default: all of them)."""
    distractors: int = 0
    """Distractor ids per pair, on average (their total is fixed, their spread over the gaps random)."""
    vocab_size: int = 256
    """The model's --vocab-size: keys in [1, V/2), values in [V/2, V)."""

    def __post_init__(self) -> None:
        if self.num_queries is None:
            object.__setattr__(self, "num_queries", self.num_pairs)
        keys, values = self.vocab_size // 2 - 1, self.vocab_size - self.vocab_size // 2
        if self.num_pairs < 1 or not 1 <= self.num_queries <= self.num_pairs:
            raise DiffmegError(
                f"MQAR needs 1 <= queries <= pairs, got {self.num_queries} queries of {self.num_pairs} pairs"
            )
        if self.distractors < 0:
            raise DiffmegError(f"--distractors must be >= 0, got {self.distractors}")
        if self.num_pairs > min(keys, values):
            raise DiffmegError(
                f"{self.num_pairs} distinct keys and values need --vocab-size >= {2 * self.num_pairs + 2} "
                f"(keys from [1, V/2), values from [V/2, V)); got {self.vocab_size}"
            )
        if self.distractors and self.num_pairs >= keys:
            raise DiffmegError(
                f"distractors are key ids other than the {self.num_pairs} keys, and --vocab-size "
                f"{self.vocab_size} leaves none; use a larger vocabulary"
            )

    @property
    def doc_length(self) -> int:
        return self.num_pairs * (2 + self.distractors) + 2 * self.num_queries

    @property
    def seq_length(self) -> int:
        """The --seq-length that holds one document per sample (inputs are all tokens but the last)."""
        return self.doc_length - 1

    @property
    def name(self) -> str:
        """A short label such as ``kv16`` or ``kv32-d2``."""
        queries = "" if self.num_queries == self.num_pairs else f"-q{self.num_queries}"
        distractors = f"-d{self.distractors}" if self.distractors else ""
        return f"kv{self.num_pairs}{queries}{distractors}"


def mqar_document(setting: MQARSetting, seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Document ``index`` of seed ``seed``: (tokens int64, loss mask bool), ``doc_length`` each."""
    rng = np.random.default_rng((SEED_TAG, seed, index))
    n, q, half = setting.num_pairs, setting.num_queries, setting.vocab_size // 2
    keys = rng.choice(np.arange(1, half), size=n, replace=False)
    values = rng.choice(np.arange(half, setting.vocab_size), size=n, replace=False)
    gaps = rng.multinomial(setting.distractors * n, np.full(n, 1.0 / n)) if setting.distractors else None
    pool = np.setdiff1d(np.arange(1, half), keys) if setting.distractors else None
    parts = []
    for i in range(n):
        parts.append([keys[i], values[i]])
        if gaps is not None and gaps[i]:
            parts.append(rng.choice(pool, size=gaps[i]))
    queried = rng.permutation(n)[:q]
    query = np.stack([keys[queried], values[queried]], axis=1).reshape(-1)  # [k, v, k, v, ...]
    context = np.concatenate(parts).astype(np.int64)
    tokens = np.concatenate([context, query])
    mask = np.zeros(len(tokens), dtype=bool)
    mask[len(context) + 1 :: 2] = True  # the value after each query key
    return tokens, mask


def query_key_positions(tokens: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """For each answer position of an MQAR document, the first occurrence of its query key (the token
    before the answer): the key of the queried context pair, whose value follows it."""
    return np.array([int(np.flatnonzero(tokens == tokens[pos - 1])[0]) for pos in answers], dtype=np.int64)


def pair_indices(tokens: np.ndarray, answers: np.ndarray, vocab_size: int) -> np.ndarray:
    """For each answer position of an MQAR document, the context pair its query key belongs to.

    The key is the token before the answer; its pair index counts the value ids (the upper half of the
    vocabulary) before the key's first occurrence, since in the context values appear only in pairs.
    """
    is_value = tokens >= vocab_size // 2
    return np.array(
        [int(is_value[:first].sum()) for first in query_key_positions(tokens, answers)], dtype=np.int64
    )


def write_mqar_dataset(
    prefix: str, setting: MQARSetting, documents: int, seed: int, overwrite: bool = False
) -> dict:
    """Write ``documents`` MQAR documents (and their loss mask, and PREFIX.mqar.json) atomically.

    Returns the metadata written to PREFIX.mqar.json.
    """
    if documents < 1:
        raise DiffmegError(f"--documents must be >= 1, got {documents}")
    dtype = np.uint16 if setting.vocab_size <= 65536 else np.int32
    with MaskedWriter(prefix, dtype=dtype, overwrite=overwrite) as writer:
        chunk = max(1, 2**20 // setting.doc_length)  # ~1M tokens per write
        for start in range(0, documents, chunk):
            docs = [mqar_document(setting, seed, i) for i in range(start, min(documents, start + chunk))]
            tokens = np.concatenate([d[0] for d in docs])
            mask = np.concatenate([d[1] for d in docs])
            writer.add_documents(tokens, mask, np.full(len(docs), setting.doc_length))
        writer.commit()
    metadata = {
        "setting": asdict(setting),
        "name": setting.name,
        "seed": seed,
        "documents": documents,
        "doc_length": setting.doc_length,
        "seq_length": setting.seq_length,
        "loss_mask": os.path.basename(loss_mask_prefix(prefix)),
    }
    write_json(prefix + METADATA_SUFFIX, metadata)
    return metadata


def read_mqar_metadata(prefix: str) -> dict | None:
    """PREFIX.mqar.json, or None for a dataset that was not generated here."""
    path = prefix + METADATA_SUFFIX
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
