"""The smallest and largest token id a dataset holds, so a run refuses data its vocabulary cannot embed
(`diffmeg.data.tokenizers.check_vocabulary`) before a step, instead of an index error inside the embedding.

A dataset's range is `{prefix}.ids.json` beside its `.bin`/`.idx`: `min_id`, `max_id` and the `.bin`'s
size and modification time it was taken from. diffmeg's writers record it as they write
(`diffmeg.data.indexed.IndexedWriter`); a dataset from elsewhere (Megatron-LM's own tools, a copy without
it) gets it computed once on first use - numpy over the memory-mapped `.bin` in chunks of `CHUNK_TOKENS`,
so a multi-GB file never sits in memory - and cached beside the data when that folder is writable, else
under `$DIFFMEG_CACHE_DIR/token_ranges/`, else in memory for this process. A `.bin` whose size or
modification time differs from the recorded one is scanned again, so a replaced file is never judged by
its predecessor's range.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from megatron.core.datasets.indexed_dataset import _IndexReader, get_bin_path, get_idx_path

from diffmeg.storage import default_cache_dir, write_json

RANGE_SUFFIX = ".ids.json"
"""`{prefix}.ids.json`: the dataset's token-id range, keyed by its `.bin`'s size and mtime."""
CHUNK_TOKENS = 1 << 24
"""Tokens scanned at a time (64 MiB of int32), each chunk mapped on its own and unmapped after, so a scan
holds one chunk's pages, not the file's."""
_IN_MEMORY: dict[tuple, tuple[int, int] | None] = {}
"""(realpath, size, mtime) -> range: what this process computed where nothing could be written."""

TokenRange = tuple[int, int] | None
"""(smallest id, largest id), or None for a dataset of no tokens."""


def range_path(prefix: str) -> str:
    return prefix + RANGE_SUFFIX


def _bin_key(prefix: str) -> dict[str, int]:
    stat = os.stat(get_bin_path(prefix))
    return {"bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}


def _cache_file(prefix: str) -> str:
    """The fallback cache entry of a dataset whose own folder is read-only (one per absolute path)."""
    name = hashlib.sha256(os.path.realpath(prefix).encode()).hexdigest()[:32]
    return os.path.join(default_cache_dir(), "token_ranges", name + ".json")


def _read(path: str, key: dict[str, int]) -> tuple[bool, TokenRange]:
    """(found, range) from a record whose key matches; a missing, stale or unreadable one is not found."""
    try:
        with open(path) as f:
            values = json.load(f)
        if any(values.get(k) != v for k, v in key.items()):
            return False, None
        if values["max_id"] is None:
            return True, None
        return True, (int(values["min_id"]), int(values["max_id"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False, None


def _write(path: str, key: dict[str, int], ids: TokenRange) -> bool:
    """Write the record atomically; False when it cannot be written there (read-only, no permission)."""
    lo, hi = ids if ids is not None else (None, None)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json(path, {"min_id": lo, "max_id": hi, **key})
        return True
    except OSError:
        return False


def scan_range(prefix: str, chunk_tokens: int = CHUNK_TOKENS) -> TokenRange:
    """The range of the `.bin`'s tokens, read a chunk at a time through a memory map of that chunk."""
    path = get_bin_path(prefix)
    dtype = np.dtype(_IndexReader(get_idx_path(prefix), multimodal=False).dtype)  # what its `.idx` names
    count = os.path.getsize(path) // dtype.itemsize
    ids: TokenRange = None
    for start in range(0, count, chunk_tokens):
        size = min(chunk_tokens, count - start)
        part = np.memmap(path, dtype=dtype, mode="r", offset=start * dtype.itemsize, shape=(size,))
        ids = combine(ids, (int(part.min()), int(part.max())))
        del part  # unmapped: its pages leave this process
    return ids


def record_range(prefix: str, ids: TokenRange) -> None:
    """Record the range a writer just wrote to `{prefix}.bin` (after it is in place)."""
    _store(prefix, _bin_key(prefix), ids)


def _store(prefix: str, key: dict[str, int], ids: TokenRange) -> None:
    _IN_MEMORY[(os.path.realpath(prefix), key["bin_bytes"], key["bin_mtime_ns"])] = ids
    if not _write(range_path(prefix), key, ids):
        _write(_cache_file(prefix), key, ids)  # else: this process's memory only


def token_range(prefix: str) -> TokenRange:
    """The dataset's (smallest, largest) token id: its record, else the fallback cache, else a scan (then
    recorded where it can be)."""
    key = _bin_key(prefix)
    memory_key = (os.path.realpath(prefix), key["bin_bytes"], key["bin_mtime_ns"])
    if memory_key in _IN_MEMORY:
        return _IN_MEMORY[memory_key]
    for path in (range_path(prefix), _cache_file(prefix)):
        found, ids = _read(path, key)
        if found:
            _IN_MEMORY[memory_key] = ids
            return ids
    ids = scan_range(prefix)
    _store(prefix, key, ids)
    return ids


def combine(a: TokenRange, b: TokenRange) -> TokenRange:
    """The range of two datasets (or batches) together."""
    if a is None or b is None:
        return a if b is None else b
    return min(a[0], b[0]), max(a[1], b[1])
