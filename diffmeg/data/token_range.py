"""The smallest and largest token id a dataset holds, so a run refuses data its vocabulary cannot embed
(`diffmeg.data.tokenizers.check_vocabulary`) before a step, instead of an index error inside the embedding.

A dataset's range is a small record: `min_id`, `max_id` and the `.bin`'s size and modification time it was
taken from. diffmeg's writers record it as they write (`{prefix}.ids.json`, `diffmeg.data.indexed.
IndexedWriter`); a dataset from elsewhere (Megatron-LM's own tools, a copy without it) gets it computed once
on first use - numpy over the memory-mapped `.bin` in chunks of `CHUNK_TOKENS`, so a multi-GB file never
sits in memory. In a multi-rank job (`collective=True`) the ranks split that scan: each reads 1/world of
the `.bin` and one all-reduce combines the parts, so a 4 TB corpus costs 31 GB a rank at 128 ranks, not
4 TB each. The record is kept where the next job finds it: under the job's `--data-cache-path` when given
(beside megatron-core's index cache), else beside the data when that folder is writable, else under
`$DIFFMEG_CACHE_DIR/token_ranges/` (one node's home: said in one line), else in memory for this process
(said too). A `.bin` whose size or modification time differs from the recorded one is scanned again, so a
replaced file is never judged by its predecessor's range.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import _IndexReader, get_bin_path, get_idx_path

from diffmeg.collectives import MAX, all_reduce
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


def _memory_key(prefix: str, key: dict[str, int] | None = None) -> tuple[str, int, int]:
    """This process's cache key of the dataset: its real path and its `.bin`'s key (stat'ed unless given)."""
    key = key or _bin_key(prefix)
    return os.path.realpath(prefix), key["bin_bytes"], key["bin_mtime_ns"]


def _cache_file(prefix: str, cache_dir: str | None = None) -> str:
    """The dataset's entry in a cache folder (one per absolute path): the job's `cache_dir`, else the
    per-user default."""
    name = hashlib.sha256(os.path.realpath(prefix).encode()).hexdigest()[:32]
    return os.path.join(cache_dir or default_cache_dir(), "token_ranges", name + ".json")


def _places(prefix: str, cache_dir: str | None) -> list[str]:
    """Where the record may be, in the order it is looked for and written."""
    return [*([_cache_file(prefix, cache_dir)] if cache_dir else []), range_path(prefix), _cache_file(prefix)]


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


def scan_range(prefix: str, chunk_tokens: int = CHUNK_TOKENS, part: tuple[int, int] = (0, 1)) -> TokenRange:
    """The range of the `.bin`'s tokens, read a chunk at a time through a memory map of that chunk.
    `part` = (index, parts): only the index-th of `parts` near-equal token ranges (a rank's share)."""
    path = get_bin_path(prefix)
    dtype = np.dtype(_IndexReader(get_idx_path(prefix), multimodal=False).dtype)  # what its `.idx` names
    count = os.path.getsize(path) // dtype.itemsize
    index, parts = part
    first, last = count * index // parts, count * (index + 1) // parts
    ids: TokenRange = None
    for start in range(first, last, chunk_tokens):
        size = min(chunk_tokens, last - start)
        part_ids = np.memmap(path, dtype=dtype, mode="r", offset=start * dtype.itemsize, shape=(size,))
        ids = combine(ids, (int(part_ids.min()), int(part_ids.max())))
        del part_ids  # unmapped: its pages leave this process
    return ids


def record_range(prefix: str, ids: TokenRange) -> None:
    """Record the range a writer just wrote to `{prefix}.bin` (after it is in place)."""
    _store(prefix, _bin_key(prefix), ids, None)


def _store(prefix: str, key: dict[str, int], ids: TokenRange, cache_dir: str | None) -> str | None:
    """Keep the record in the first place it can be written; that place, or None (memory only)."""
    _IN_MEMORY[_memory_key(prefix, key)] = ids
    return next((path for path in _places(prefix, cache_dir) if _write(path, key, ids)), None)


def _world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


_NONE = np.iinfo(np.int64).min
"""A part of no tokens in the all-reduce of (-min, max): the identity of MAX."""


def _split_scan(prefix: str, rank: int, world: int) -> TokenRange:
    """This rank's share of the scan, combined over the world by one all-reduce of (-min, max)."""
    ids = scan_range(prefix, part=(rank, world))
    mine = [_NONE, _NONE] if ids is None else [-ids[0], ids[1]]
    lo, hi = (int(v) for v in all_reduce(mine, op=MAX, dtype=torch.int64).tolist())
    return None if hi == _NONE else (-lo, hi)


def token_range(prefix: str, cache_dir: str | None = None, collective: bool = False) -> TokenRange:
    """The dataset's (smallest, largest) token id: its record, else a scan (then recorded where it can
    be). `cache_dir`: the job's `--data-cache-path`. `collective`: every rank of the default group calls
    this for the same prefix; they agree whether any of them lacks the record and, if so, split the scan."""
    key = _bin_key(prefix)
    memory_key = _memory_key(prefix, key)
    found, ids = memory_key in _IN_MEMORY, _IN_MEMORY.get(memory_key)
    for path in [] if found else _places(prefix, cache_dir):
        found, ids = _read(path, key)
        if found:
            _IN_MEMORY[memory_key] = ids
            break
    rank, world = _world() if collective else (0, 1)
    if world > 1:
        missing = all_reduce([0 if found else 1], op=MAX, dtype=torch.int64).item()
        if not missing:
            return ids
        ids = _split_scan(prefix, rank, world)
    elif found:
        return ids
    else:
        ids = scan_range(prefix)
    if rank == 0:
        kept = _store(prefix, key, ids, cache_dir)
        if kept is None or (kept == _cache_file(prefix) and (world > 1 or cache_dir)):
            where = f"in {kept}, one node's cache" if kept else "in memory only: nothing could be written"
            print(
                f"token-id range of {prefix} kept {where}; pass --data-cache-path on storage every node "
                "can write so the next job skips the scan",
                flush=True,
            )
    else:
        _IN_MEMORY[memory_key] = ids
    if world > 1:
        torch.distributed.barrier()  # the record is in place before any rank goes on
    return ids


def combine(a: TokenRange, b: TokenRange) -> TokenRange:
    """The range of two datasets (or batches) together."""
    if a is None or b is None:
        return a if b is None else b
    return min(a[0], b[0]), max(a[1], b[1])
