"""Length upsampling for long-context training (the 64K extension): bucket documents by length.

The paper extends DIFF-3B to 64K context on a corpus "up-sampled according to sequence length".
We make that a blend megatron-core already understands:

1. Every document of the input datasets (in order) goes to a length bucket by its token count n.
   Default buckets: ``short`` (n < T) and ``long`` (n >= T), T = the target context (65536);
   ``edges`` gives more (``short`` < e1 <= ``mid1`` < e2 ... <= ``long``).
2. Each bucket is written as its own dataset ``{out}_{bucket}`` (documents in input order).
3. Bucket b gets blend weight ``w_b ∝ f_b * N_b``, N_b = its tokens, f_b = its upsampling factor.
   With every f_b = 1 the blend reproduces the corpus's own token mix (what training on the
   unbucketed data sees), so f_b reads directly as "tokens from bucket b are seen f_b times as
   often as under natural sampling". Default: f = 1 for all buckets except ``long`` = ``long_factor``.
   The long bucket's share of training tokens is then ``f N_long / (f N_long + N_short)``.

Only documents that fill the whole context (n >= T) teach attention over the full 64K; packing
short documents into a 64K sample does not. Weighting by tokens (not documents) keeps the weights
comparable to the natural distribution and independent of how documents happen to be split.
Buckets without tokens are left out of the blend (megatron-core cannot sample from them).
Outputs: the bucket datasets, ``{out}_weights.txt`` (the ``--data-path`` value, ``w1 p1 w2 p2``)
and ``{out}_upsample.json`` (counts, weights, token shares).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset, _IndexReader, get_idx_path

from diffmeg.data.indexed import (
    DiskFullError,
    IndexedWriter,
    abort_writers,
    check_can_write,
    check_output_prefix,
    exists,
    remove_stale_temporaries,
)
from diffmeg.data.tokenizers import common_record, write_dataset_record
from diffmeg.errors import DiffmegError
from diffmeg.storage import atomic_write, free_bytes, is_disk_full


@dataclass
class Bucket:
    name: str
    min_length: int
    """Documents with min_length <= tokens < max_length (max_length None: no upper bound)."""
    max_length: int | None
    factor: float
    prefix: str
    documents: int = 0
    tokens: int = 0
    weight: float = 0.0
    """Normalised blend weight (0: left out, no tokens)."""
    token_share: float = 0.0
    """Fraction of training tokens drawn from this bucket (= weight)."""
    natural_share: float = 0.0
    """Fraction of the corpus's tokens in this bucket (the share without upsampling)."""


@dataclass
class UpsampleResult:
    buckets: list[Bucket]
    data_path: list[str]
    """``--data-path`` values: ``w1 p1 w2 p2 ...``."""
    weights_file: str
    summary_file: str

    @property
    def data_path_string(self) -> str:
        return " ".join(self.data_path)


def plan_buckets(
    output_prefix: str,
    target_length: int,
    long_factor: float,
    edges: Sequence[int] | None = None,
    factors: Sequence[float] | None = None,
) -> list[Bucket]:
    """The buckets and their factors (see the module docstring)."""
    if target_length < 1:
        raise DiffmegError(f"--target-length must be >= 1, got {target_length}")
    edges = list(edges) if edges else [target_length]
    if any(e < 1 for e in edges) or sorted(set(edges)) != edges:
        raise DiffmegError(f"--edges must be increasing positive token counts, got {edges}")
    if factors is None:
        factors = [1.0] * len(edges) + [long_factor]
    factors = [float(f) for f in factors]
    if len(factors) != len(edges) + 1:
        raise DiffmegError(f"--factors needs {len(edges) + 1} values (one per bucket), got {len(factors)}")
    if any(not np.isfinite(f) or f <= 0 for f in factors):
        raise DiffmegError(f"upsampling factors must be > 0, got {factors}")
    bounds = [0, *edges, None]
    names = ["short", *(f"mid{k}" for k in range(1, len(edges))), "long"]  # short < e1 <= mid1 < e2 ... long
    return [
        Bucket(name, bounds[i], bounds[i + 1], factors[i], f"{output_prefix}_{name}")
        for i, name in enumerate(names)
    ]


def length_upsample(
    inputs: Sequence[str],
    output_prefix: str,
    target_length: int = 65536,
    long_factor: float = 4.0,
    edges: Sequence[int] | None = None,
    factors: Sequence[float] | None = None,
    overwrite: bool = False,
) -> UpsampleResult:
    """Split ``inputs`` into length buckets, write them, and return the weighted blend."""
    if not inputs:
        raise DiffmegError("no --input datasets given")
    check_output_prefix(output_prefix, extended=True)  # buckets are {prefix}_short ...
    for prefix in inputs:
        if not exists(prefix):
            raise DiffmegError(f"dataset {prefix} not found: need {prefix}.bin and {prefix}.idx")
    buckets = plan_buckets(output_prefix, target_length, long_factor, edges, factors)
    weights_file, summary_file = f"{output_prefix}_weights.txt", f"{output_prefix}_upsample.json"
    check_can_write([b.prefix for b in buckets], overwrite)
    for path in (weights_file, summary_file):
        if os.path.exists(path) and not overwrite:
            raise DiffmegError(f"output {path} already exists; pass --overwrite to replace it")
    remove_stale_temporaries([b.prefix for b in buckets])
    remove_stale_temporaries([weights_file, summary_file], datasets=False)
    dtypes = {np.dtype(_IndexReader(get_idx_path(p), multimodal=False).dtype) for p in inputs}
    if len(dtypes) != 1:
        raise DiffmegError(
            f"inputs store different token types {sorted(d.name for d in dtypes)}; use one tokenizer"
        )

    record = common_record(inputs)  # one tokenizer's ids, or a one-line refusal
    uppers = np.array([b.max_length if b.max_length is not None else np.iinfo(np.int64).max for b in buckets])

    dtype = dtypes.pop().type
    writers: list[IndexedWriter] = []
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        for bucket in buckets:
            writers.append(IndexedWriter(bucket.prefix, dtype=dtype))
        for prefix in inputs:
            dataset = IndexedDataset(prefix)
            doc_index = dataset.document_indices
            seq_lengths = dataset.sequence_lengths.astype(np.int64)
            cumulative = np.concatenate([[0], np.cumsum(seq_lengths)])
            doc_lengths = cumulative[doc_index[1:]] - cumulative[doc_index[:-1]]
            targets = np.searchsorted(uppers, doc_lengths, side="right")
            for d, b in enumerate(targets.tolist()):
                first, last = int(doc_index[d]), int(doc_index[d + 1])
                lengths = seq_lengths[first:last].tolist()
                tokens = np.concatenate(dataset[first:last]) if last > first else np.zeros(0, dtype)
                writers[b].add_document(tokens, lengths)
                buckets[b].documents += 1
                buckets[b].tokens += int(doc_lengths[d])
            del dataset
        total = sum(b.tokens for b in buckets)
        if total == 0:
            raise DiffmegError("the input datasets hold no tokens")
        mass = sum(b.factor * b.tokens for b in buckets)
        for bucket, writer in zip(buckets, writers, strict=True):
            bucket.natural_share = bucket.tokens / total
            bucket.weight = bucket.token_share = bucket.factor * bucket.tokens / mass
            if bucket.tokens:
                writer.commit()
                if record is not None:
                    write_dataset_record(bucket.prefix, record)
            else:
                writer.abort()
    except BaseException as exc:
        abort_writers(writers, exc, out_dir)  # a full disk: one DiskFullError line
        raise
    finally:
        for writer in writers:
            writer.abort()
    data_path = []
    for bucket in buckets:
        if bucket.tokens:
            data_path += [f"{bucket.weight:.6g}", bucket.prefix]
    _write_text(weights_file, " ".join(data_path) + "\n")
    summary = {
        "inputs": list(inputs),
        "target_length": target_length,
        "scheme": "weight_b = factor_b * tokens_b / sum_c(factor_c * tokens_c)",
        "buckets": [asdict(b) for b in buckets],
        "data_path": data_path,
    }
    _write_text(summary_file, json.dumps(summary, indent=2) + "\n")
    return UpsampleResult(buckets, data_path, weights_file, summary_file)


def _write_text(path: str, text: str) -> None:
    try:
        with atomic_write(path) as f:
            f.write(text)
    except OSError as exc:
        if is_disk_full(exc):
            directory = os.path.dirname(os.path.abspath(path))
            raise DiskFullError(directory, 0, free_bytes(directory)) from None
        raise
