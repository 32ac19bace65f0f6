"""Writing and merging megatron-core indexed datasets (``{prefix}.bin`` + ``{prefix}.idx``) safely.

A dataset counts as present when both files exist, so every writer here builds under temporary
names (``.bin.tmp-<pid>``, never ending in ``.bin``/``.idx``) and renames only when complete: the
``.bin`` first, the ``.idx`` last. An interrupted run therefore never leaves a pair that looks
complete, and replacing an existing dataset removes its old ``.idx`` before anything else moves.

A run killed outright (SIGKILL, a node failure) cannot remove its temporaries; the next run for the
same output removes those whose process is gone (``remove_stale_temporaries``). The process id in the
name is checked on this host only: never write one output prefix from two nodes at once. A full disk
(or quota) ends a writer with one line naming the directory, the free space and what was written
(``DiskFullError``), after its temporaries are removed. A committed dataset gets its token-id range
recorded beside it (``{prefix}.ids.json``, ``diffmeg.data.token_range``), which runs check against their
vocabulary.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import (
    _INDEX_HEADER,
    DType,
    IndexedDatasetBuilder,
    _IndexReader,
    get_bin_path,
    get_idx_path,
)

from diffmeg.data.token_range import TokenRange, combine, record_range, token_range
from diffmeg.errors import DiffmegError, stderr
from diffmeg.storage import check_output, format_bytes, free_bytes, is_disk_full

TOKEN_DTYPE = np.int32
"""cl100k ids exceed uint16; megatron-core picks int32 for vocabularies over 65536 too."""

_SHARD_RE = re.compile(r"-rank(\d+)-of-(\d+)(?=_|$)")
_TMP_RE = re.compile(r"\.tmp-(\d+)(?:-[^/]*)?$")
"""A temporary's owner: ``<name>.tmp-<pid>`` (files) or ``<name>.tmp-<pid>-<random>`` (scratch dirs)."""


class DiskFullError(DiffmegError):
    """The output's file system (or the user's quota) ran out of space; partial files are removed."""

    def __init__(self, directory: str, written: int, free: int | None = None) -> None:
        self.directory, self.written = directory, written
        free = free_bytes(directory) if free is None else free
        super().__init__(
            f"disk full in {directory}: {format_bytes(free) if free >= 0 else 'unknown'} free after "
            f"{format_bytes(written)} of output were written; the partial output was removed. Free space "
            "(or raise the quota) and rerun, or write elsewhere"
        )


def abort_writers(
    writers: Sequence[IndexedWriter],
    exc: BaseException | None,
    directory: str,
    extra_written: Callable[[], int] | None = None,
) -> None:
    """Abort ``writers`` (removing their temporaries); a full disk behind ``exc`` becomes one
    ``DiskFullError`` line instead of a traceback. ``extra_written``: other bytes the run wrote."""
    if not is_disk_full(exc):
        for writer in writers:
            writer.abort()
        return
    free = free_bytes(directory)  # before the partial files go: what the failing write saw
    written = extra_written() if extra_written else 0
    for writer in writers:
        writer.abort()
    raise DiskFullError(directory, written + sum(w.discarded_bytes for w in writers), free) from None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process on this host; unknown counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_temporaries(
    paths: Iterable[str], log: Callable[[str], None] = stderr, datasets: bool = True
) -> list[str]:
    """Remove the temporaries a killed run left for these outputs; refuse those of a running one.

    ``paths`` are dataset prefixes (their ``.bin``/``.idx`` and scratch directories are checked) or,
    with ``datasets=False``, plain output files. Returns the paths removed; logs one line per process.
    """
    found: dict[int, list[str]] = {}
    for path in paths:
        bases = [get_bin_path(path), get_idx_path(path), path] if datasets else [path]
        for base in bases:
            for tmp in glob.glob(glob.escape(base) + ".tmp-*"):
                match = _TMP_RE.search(tmp[len(base) :])
                if match and int(match.group(1)) != os.getpid():
                    found.setdefault(int(match.group(1)), []).append(tmp)
    removed: list[str] = []
    for pid, tmps in sorted(found.items()):
        if pid_alive(pid):
            raise DiffmegError(
                f"process {pid} is writing the same output now ({tmps[0]}); wait for it or choose another "
                f"output (if no such run is active, delete {tmps[0]})"
            )
        for tmp in sorted(tmps):
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            elif os.path.lexists(tmp):
                os.remove(tmp)
            removed.append(tmp)
        log(
            f"removed {len(tmps)} stale temporaries of process {pid}, which no longer runs: "
            + ", ".join(sorted(tmps))
        )
    return removed


def exists(prefix: str) -> bool:
    """Whether both files of the dataset are present (the only state we call complete)."""
    return os.path.isfile(get_bin_path(prefix)) and os.path.isfile(get_idx_path(prefix))


_HEADER = struct.Struct("<9sQBQQ")
"""An `.idx` header: magic, version (1), token dtype code, sequence count, document count."""


def check_dataset(prefix: str) -> int:
    """The tokens of dataset `prefix` after cheap consistency checks of its pair, or one line naming the
    file and what is wrong: the `.idx` header, its size against its counts, its first and last document
    indices, and the `.bin` size its last sequence's end implies (a truncated copy). Reads the header
    and a few index entries, whatever the dataset's size."""
    idx, bin_ = get_idx_path(prefix), get_bin_path(prefix)
    again = "copy it again or write the dataset again with tools/preprocess_data.py"
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)
    with open(idx, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size or not raw.startswith(_INDEX_HEADER):
        raise DiffmegError(f"{idx} is not a megatron-core dataset index (no MMIDIDX header); {again}")
    _, version, code, sequences, documents = _HEADER.unpack(raw)
    try:
        itemsize = DType.size(DType.dtype_from_code(code))
    except (KeyError, ValueError):
        itemsize = 0
    if version != 1 or not itemsize:
        raise DiffmegError(f"{idx} has an unknown version {version} or token type {code}; {again}")
    expected_idx = _HEADER.size + 12 * sequences + 8 * documents
    if idx_size not in (expected_idx, expected_idx + sequences):  # + one mode byte per sequence: multimodal
        raise DiffmegError(
            f"{idx} is {idx_size} bytes but its header ({sequences} sequences, {documents} document "
            f"indices) needs {expected_idx}: truncated or damaged; {again}"
        )
    index = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = index[_HEADER.size : _HEADER.size + 4 * sequences].view(np.int32)
    pointers = index[_HEADER.size + 4 * sequences : _HEADER.size + 12 * sequences].view(np.int64)
    docs = index[_HEADER.size + 12 * sequences : expected_idx].view(np.int64)
    if documents == 0 or docs[0] != 0 or docs[-1] != sequences:
        raise DiffmegError(
            f"{idx}: its document indices do not span its {sequences} sequences (damaged); {again}"
        )
    end = int(pointers[-1]) + int(lengths[-1]) * itemsize if sequences else 0
    if sequences and (int(pointers[0]) != 0 or int(lengths.min()) < 0 or end < int(pointers[-1])):
        raise DiffmegError(f"{idx}: its sequence offsets are damaged; {again}")
    if bin_size != end:
        what = "truncated (an interrupted copy?)" if bin_size < end else "longer than its index describes"
        raise DiffmegError(
            f"{bin_} is {bin_size} bytes but its index {os.path.basename(idx)} expects {end} "
            f"({sequences} sequences of {documents - 1} documents): {what}; {again}"
        )
    return end // itemsize


LOSS_MASK_SUFFIX = ".loss_mask"
"""The mask of dataset PREFIX is the indexed dataset PREFIX.loss_mask (PREFIX.loss_mask.bin/.idx): the
companion `diffmeg.data.loss_mask` writes and reads; listings and merges here keep the two together."""


def loss_mask_prefix(prefix: str) -> str:
    return prefix + LOSS_MASK_SUFFIX


def is_loss_mask_prefix(prefix: str) -> bool:
    """Whether this prefix is itself a mask companion (listings of datasets leave those out)."""
    return prefix.endswith(LOSS_MASK_SUFFIX)


def has_loss_mask(prefix: str) -> bool:
    return exists(loss_mask_prefix(prefix))


def check_output_prefix(prefix: str, extended: bool = False) -> None:
    """``--output-prefix`` names the start of file names, not a folder: ``data/`` would write hidden
    ``data/.bin`` (or ``data/_text_document.bin``). ``extended``: the tool appends to the prefix (``_text_
    document``), so an existing folder there is a folder meant (megatron-core's index cache is a folder
    named as a dataset's own prefix: for a prefix used as is, that is no mistake)."""
    folder = prefix.endswith(("/", os.sep)) or (extended and os.path.isdir(prefix))
    if not os.path.basename(prefix) or folder:
        example = os.path.join(prefix.rstrip("/" + os.sep) or ".", "corpus")
        raise DiffmegError(
            f"--output-prefix {prefix} names a folder, not the start of the output files' names; give a name "
            f"inside it, e.g. --output-prefix {example}"
        )


def check_can_write(prefixes: Iterable[str], overwrite: bool) -> None:
    """Fail before any work if an output prefix names a folder, an output exists and ``--overwrite`` was
    not given, or its folder cannot be written (read-only, no permission, a file in the way:
    `diffmeg.storage.check_output`); then create the missing output folders (as pretrain_diff.py and
    convert_checkpoint.py do)."""
    parents = []
    for prefix in prefixes:
        check_output_prefix(prefix)
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            if os.path.exists(path) and not overwrite:
                raise DiffmegError(f"output {path} already exists; pass --overwrite to replace it")
            check_output(path, "--output-prefix", folder=False)
        parents.append(os.path.dirname(os.path.abspath(prefix)))
    for parent in parents:
        os.makedirs(parent, exist_ok=True)


class IndexedWriter:
    """An ``IndexedDatasetBuilder`` writing under temporary names until ``commit()``.

    Use as a context manager: leaving the block without ``commit()`` (an error, Ctrl-C, SIGTERM
    turned into SystemExit) deletes the temporary files.
    """

    def __init__(self, prefix: str, dtype: type[np.number] = TOKEN_DTYPE) -> None:
        self.prefix = prefix
        self.documents = 0
        self.tokens = 0
        tag = f".tmp-{os.getpid()}"
        self._tmp_bin = get_bin_path(prefix) + tag
        self._tmp_idx = get_idx_path(prefix) + tag
        self._builder = IndexedDatasetBuilder(self._tmp_bin, dtype=dtype)
        self._done = False
        self.discarded_bytes = 0
        """Bytes of temporary files ``abort()`` removed (what a failed run had written)."""
        self.ids: TokenRange = None
        """The smallest and largest token id written, recorded beside the dataset on ``commit()``."""

    def add_document(self, tokens: np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """One document: one sequence (so document i is ``IndexedDataset[i]``), or ``lengths``."""
        self._builder.add_document(tokens, [len(tokens)] if lengths is None else list(lengths))
        self._saw(tokens)
        self.documents += 1
        self.tokens += len(tokens)

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many one-sequence documents at once: ``tokens`` concatenated, ``lengths`` per document.

        The same bytes and index entries as ``add_document`` per document, in one write (the
        builder's per-call overhead was a third of the writer process's time).
        """
        builder = self._builder
        builder.data_file.write(np.ascontiguousarray(tokens, dtype=builder.dtype).tobytes(order="C"))
        start = len(builder.sequence_lengths)
        builder.sequence_lengths.extend(int(n) for n in lengths)
        builder.document_indices.extend(range(start + 1, start + len(lengths) + 1))
        self._saw(tokens)
        self.documents += len(lengths)
        self.tokens += int(np.sum(lengths, dtype=np.int64))

    def add_dataset(self, prefix: str) -> None:
        """Append a whole dataset (same dtype) by copying its files."""
        index = _IndexReader(get_idx_path(prefix), multimodal=False)
        if index.dtype != self._builder.dtype:
            raise DiffmegError(
                f"{prefix} stores {np.dtype(index.dtype).name} tokens but the output stores "
                f"{np.dtype(self._builder.dtype).name}; merge only datasets made with one tokenizer"
            )
        self.documents += len(index.document_indices) - 1
        self.tokens += int(index.sequence_lengths.sum(dtype=np.int64))
        del index
        self.ids = combine(self.ids, token_range(prefix))  # its record, else one scan (as a copy reads it)
        self._builder.add_index(prefix)

    def _saw(self, tokens: np.ndarray) -> None:
        if len(tokens):
            self.ids = combine(self.ids, (int(np.min(tokens)), int(np.max(tokens))))

    def commit(self) -> None:
        """Write the index and move both files into place, ``.idx`` last."""
        self._builder.finalize(self._tmp_idx)
        final_bin, final_idx = get_bin_path(self.prefix), get_idx_path(self.prefix)
        if os.path.exists(final_idx):
            os.remove(final_idx)  # the old .idx must never describe the new .bin
        os.replace(self._tmp_bin, final_bin)
        os.replace(self._tmp_idx, final_idx)
        self._done = True
        if not is_loss_mask_prefix(self.prefix):  # mask bits are no token ids
            record_range(self.prefix, self.ids)

    def abort(self) -> None:
        """Close and delete the temporary files (idempotent)."""
        if self._done:
            return
        self._done = True
        if not self._builder.data_file.closed:
            try:
                self._builder.data_file.close()
            except OSError:
                pass  # flushing the rest failed (a full disk): the file is closed and goes anyway
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                self.discarded_bytes += os.path.getsize(path)
                os.remove(path)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        abort_writers([self], exc, os.path.dirname(os.path.abspath(self.prefix)))


def resolve_prefixes(specs: Sequence[str]) -> list[str]:
    """Dataset prefixes from prefixes, ``.bin``/``.idx`` paths, globs, or directories.

    Globs and directories expand in sorted order (zero-padded shard names sort by rank); explicit
    prefixes keep the order given. Each prefix appears once.
    """
    prefixes: list[str] = []
    for spec in specs:
        if os.path.isdir(spec):
            found = datasets_in(spec)
            if not found:
                raise DiffmegError(f"directory {spec} holds no .bin/.idx dataset")
        elif glob.has_magic(spec):
            found = _prefixes_from_paths(glob.glob(spec) + glob.glob(spec + ".idx"))
            if not found:
                raise DiffmegError(f"no dataset (.bin + .idx) matches {spec!r}")
        else:
            prefix = strip_ext(spec)
            if not exists(prefix):
                raise DiffmegError(f"dataset {prefix} not found: need {prefix}.bin and {prefix}.idx")
            found = [prefix]
        prefixes.extend(p for p in found if p not in prefixes)
    return prefixes


def datasets_in(folder: str) -> list[str]:
    """The complete datasets (``.bin`` + ``.idx``, loss masks left out) directly inside `folder`, sorted."""
    return _prefixes_from_paths(glob.glob(os.path.join(glob.escape(folder), "*.idx")))


def strip_ext(path: str) -> str:
    """A dataset's prefix from its prefix or either of its files' paths."""
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def _prefixes_from_paths(paths: Iterable[str]) -> list[str]:

    prefixes = {strip_ext(p) for p in paths if p.endswith((".bin", ".idx"))}
    return sorted(p for p in prefixes if exists(p) and not is_loss_mask_prefix(p))


def order_shards(prefixes: Sequence[str]) -> list[str]:
    """Per-rank shards (``...-rankR-of-N...``) in rank order, after checking all N are present.

    Inputs that are not one shard set come back unchanged.
    """
    matches = [_SHARD_RE.search(os.path.basename(p)) for p in prefixes]
    if not matches or not all(matches):
        return list(prefixes)
    stems = {_SHARD_RE.sub("", os.path.basename(p)) for p in prefixes}
    sizes = {int(m.group(2)) for m in matches}
    if len(stems) != 1 or len(sizes) != 1:
        return list(prefixes)
    (size,) = sizes
    ranks = [int(m.group(1)) for m in matches]
    if sorted(ranks) != list(range(size)):
        missing = sorted(set(range(size)) - set(ranks))
        raise DiffmegError(
            f"shard set {stems.pop()} is incomplete: missing rank(s) {missing} of {size} "
            "(did a rank fail?); rerun those ranks before merging"
        )
    return [p for _, p in sorted(zip(ranks, prefixes, strict=True))]


def merge_datasets(prefixes: Sequence[str], output_prefix: str, overwrite: bool = False) -> IndexedWriter:
    """Concatenate datasets, in the order given, into ``output_prefix`` (atomically)."""
    if not prefixes:
        raise DiffmegError("nothing to merge: no input datasets")
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in prefixes):
        raise DiffmegError(f"output {output_prefix} is also an input; choose another --output-prefix")
    check_can_write([output_prefix], overwrite)
    remove_stale_temporaries([output_prefix])
    masked = [p for p in prefixes if has_loss_mask(p)]
    if masked and len(masked) < len(prefixes):
        unmasked = next(p for p in prefixes if p not in masked)
        raise DiffmegError(f"{masked[0]} has a loss mask but {unmasked} has none; merge only one kind")
    if masked:  # the masks first, as every masked writer does
        merge_datasets([loss_mask_prefix(p) for p in prefixes], loss_mask_prefix(output_prefix), overwrite)
    from diffmeg.data.tokenizers import common_record, write_dataset_record

    record = common_record(prefixes)  # one tokenizer's ids, or a one-line refusal
    dtype = _IndexReader(get_idx_path(prefixes[0]), multimodal=False).dtype
    with IndexedWriter(output_prefix, dtype=dtype) as writer:  # a full disk: DiskFullError
        for prefix in prefixes:
            writer.add_dataset(prefix)
        writer.commit()
    if record is not None:
        write_dataset_record(output_prefix, record)
    return writer
