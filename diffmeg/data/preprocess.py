"""Tokenize corpora into megatron-core indexed datasets: the logic behind tools/preprocess_data.py.

Inputs: JSON lines (``.jsonl``, or ``.json`` holding one object per line as in Megatron-LM) and
plain text (``.txt``: the whole file is one document), each optionally ``.gz`` or ``.zst``; tables
(diffmeg/data/tables.py): Parquet and Arrow files, ``datasets`` save_to_disk folders and ``hf:NAME[:SPLIT]``
from the local Hugging Face cache, a row per record and ``--json-keys`` naming columns.
Every input record becomes one document stored as one sequence, in input order, so document i of
every ``{prefix}_{key}_document`` dataset is record i (a table's rows give the same datasets as the same
texts in JSON lines). Empty texts are kept as empty documents
(or a lone EOD with ``--append-eod``) to keep that alignment; blank lines are not records.

Parallelism, from the outside in:
- ranks (mpirun/srun) take contiguous, byte-balanced slices of the input and write per-rank shards
  ``{prefix}-rankRRRRR-of-NNNNN_{key}_document``, merged afterwards by tools/merge_datasets.py;
- ``--partitions`` processes each take a contiguous slice and write a scratch shard that is merged
  into the output at the end;
- ``--workers`` (in total, shared among partitions) encode batches of lines; the reading process
  writes their results in order. With one worker per partition, encoding runs in that process.
Uncompressed JSON lines are split at line boundaries, tables between row groups (Parquet) or record batches
(Arrow); compressed and text files go whole.

Outputs are written under temporary names and renamed when complete (diffmeg/data/indexed.py): an
interrupted run leaves nothing that looks like a dataset, the next run for the same prefix removes what
a killed one left, and a full disk ends the run with one line (directory, free space, bytes written).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from diffmeg.data import tables
from diffmeg.data.indexed import (
    DiskFullError,
    IndexedWriter,
    abort_writers,
    check_can_write,
    check_output_prefix,
    has_loss_mask,
    loss_mask_prefix,
    remove_stale_temporaries,
)
from diffmeg.data.tokenizers import record_of, write_dataset_record
from diffmeg.errors import DiffmegError, stderr
from diffmeg.storage import directory_bytes

SUPPORTED = (
    ".jsonl, .json (one object per line), .txt (one document per file), each optionally .gz/.zst; "
    ".parquet, .arrow, a datasets save_to_disk folder, hf:NAME[:SPLIT] (the local Hugging Face cache)"
)
_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "text", ".parquet": "table", ".arrow": "table"}
_COMPRESSIONS = {".gz": "gz", ".zst": "zst"}
_COMPRESSED = (
    (re.compile(rb"\x1f\x8b"), "gz", "gzip"),
    (re.compile(rb"\x28\xb5\x2f\xfd"), "zst", "zstd"),
    (re.compile(rb"BZh[1-9]1AY&SY"), "bz2", "bzip2"),
    (re.compile(rb"\xfd7zXZ\x00"), "xz", "xz"),
)
"""Each compressed format's first bytes, its suffix and its program: a compressed file whose name does not
say so is named as such."""
BATCH_BYTES = 1 << 20


@dataclass(frozen=True)
class InputFile:
    path: str
    kind: str
    """"jsonl", "text" or "table"."""
    compression: str
    """"", "gz" or "zst"."""
    size: int
    """Bytes stored; a table's: those of its row groups or record batches (`layout.bounds[-1]`)."""
    layout: tables.TableLayout | None = None
    """A table's units (row groups, record batches): its offsets are theirs, not the file's."""

    @property
    def splittable(self) -> bool:
        """Whether ranges of the file can be read on their own (plain JSON lines, tables)."""
        return self.kind == "table" or (self.kind == "jsonl" and not self.compression)


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` of a stored file; starts and ends on line boundaries (a table's: on unit
    boundaries of its `layout`)."""

    file: InputFile
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def find_inputs(patterns: Iterable[str]) -> list[InputFile]:
    """Files named by paths, globs, save_to_disk folders or ``hf:`` names, globs sorted, each file once, in
    the order given."""
    paths: list[str] = []
    for pattern in patterns:
        if pattern.startswith("hf:"):
            matches = tables.hf_cached_files(pattern)
        else:
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise DiffmegError(f"--input {pattern!r} matches no file")
        for match in matches:
            saved = tables.saved_dataset_files(match) if os.path.isdir(match) else None
            for path in saved if saved is not None else [match]:
                if os.path.isdir(path):
                    raise DiffmegError(tables.describe_folder(path, SUPPORTED))
                if not os.path.isfile(path):
                    raise DiffmegError(f"--input {path} does not exist")
                if path not in paths:
                    paths.append(path)
    files = []
    for path in paths:
        name = os.path.basename(path).lower()
        stem, ext = os.path.splitext(name)
        compression = _COMPRESSIONS.get(ext, "")
        if compression:
            stem, ext = os.path.splitext(stem)
        if ext not in _KINDS or (compression and _KINDS[ext] == "table"):
            raise DiffmegError(f"--input {path}: unsupported file type; supported: {SUPPORTED}")
        if _KINDS[ext] == "table":
            layout = tables.read_layout(path)
            files.append(InputFile(path, "table", "", layout.bounds[-1], layout))
            continue
        files.append(check_format(InputFile(path, _KINDS[ext], compression, os.path.getsize(path))))
    return files


def check_format(f: InputFile) -> InputFile:
    """One line, before any work, for an input whose content is not what its name says, where reading it
    as named would blame every line on its own: a compressed file without its suffix, UTF-16 or UTF-32
    text, a JSON array (`[{...}, ...]`) or pretty-printed JSON where JSON Lines (one object per line) are
    expected."""
    with open(f.path, "rb") as raw:
        magic = raw.read(10)
    found = next(((suffix, tool) for regex, suffix, tool in _COMPRESSED if regex.match(magic)), None)
    base = f.path[: -len(f.compression) - 1] if f.compression else f.path
    if found is not None and found[0] != f.compression:
        suffix, tool = found
        named = f"named .{f.compression}" if f.compression else "without a .gz or .zst suffix"
        fix = f"rename it to {base}.{suffix}"
        if suffix not in _COMPRESSIONS.values():
            stem, ext = os.path.splitext(base)
            fix = f"decompress it first, e.g. {tool} -dc {f.path} > {stem}.plain{ext}"
        raise DiffmegError(
            f"--input {f.path} is {tool}-compressed data {named}, so it cannot be read as named; {fix}"
        )
    if not f.size:
        return f
    try:
        with open(f.path, "rb") as raw:
            head = _open_stream(raw, f).read(1 << 16)
    except (OSError, EOFError) as exc:
        raise DiffmegError(f"cannot read {f.path}: {exc}") from None
    tool = next((t for _, suffix, t in _COMPRESSED if suffix == f.compression), None)
    wide = wide_encoding(head)
    if wide is not None:
        encoding, bom = wide
        stem, ext = os.path.splitext(base)
        source = "" if tool else f" {f.path}"
        fix = f"iconv -f {encoding[:6] if bom else encoding} -t UTF-8{source} > {stem}.utf8{ext}"
        raise DiffmegError(
            f"--input {f.path} is {encoding} text{' (it starts with a byte-order mark)' if bom else ''}, not "
            f"UTF-8; convert it first, e.g. {f'{tool} -dc {f.path} | ' if tool else ''}{fix}"
        )
    if f.kind != "jsonl":
        return f
    head = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    out = os.path.splitext(base)[0] + ".jsonl"
    out = os.path.splitext(base)[0] + ".lines.jsonl" if out == base else out  # never the input itself

    array = "'.[]'"

    def convert(jq: str) -> str:  # the jq program `jq` over the file, or over what its decompressor writes
        return f"{tool} -dc {f.path} | jq -c {jq} > {out}" if tool else f"jq -c {jq} {f.path} > {out}"

    if head.startswith(b"["):
        raise DiffmegError(
            f"--input {f.path} is a JSON array ([{{...}}, {{...}}]), not JSON Lines (one object per line); "
            f"convert it first, e.g. {convert(array)}"
        )
    if head.split(b"\n", 1)[0].strip() == b"{":
        raise DiffmegError(
            f"--input {f.path} holds pretty-printed JSON (an object over several lines), not JSON Lines (one "
            f"object per line); convert it first, e.g. {convert('.')}"
        )
    return f


_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32LE"),
    (b"\x00\x00\xfe\xff", "UTF-32BE"),
    (b"\xff\xfe", "UTF-16LE"),
    (b"\xfe\xff", "UTF-16BE"),
)
_NUL_PATTERNS = (  # where an ASCII-heavy text's NUL bytes fall, by position modulo 4
    ((1, 2, 3), "UTF-32LE"),
    ((0, 1, 2), "UTF-32BE"),
    ((1, 3), "UTF-16LE"),
    ((0, 2), "UTF-16BE"),
)


def wide_encoding(head: bytes) -> tuple[str, bool] | None:
    """UTF-16/UTF-32 (the encoding, and whether a byte-order mark says so) from a file's first bytes: by its
    byte-order mark, else by where its NUL bytes fall (UTF-8 text holds none). Every line of such a file
    would otherwise be a bad line, "not valid UTF-8"."""
    for bom, encoding in _BOMS:
        if head.startswith(bom):
            return encoding, True
    sample = head[: len(head) // 4 * 4]
    if len(sample) < 8 or b"\x00" not in sample:
        return None
    quarter = len(sample) // 4
    nul = [sample[i::4].count(0) / quarter for i in range(4)]
    for positions, encoding in _NUL_PATTERNS:
        if all(nul[i] > 0.5 for i in positions) and all(
            nul[i] < 0.05 for i in range(4) if i not in positions
        ):
            return encoding, False
    return None


def split_segments(segments: list[Segment], n: int) -> list[list[Segment]]:
    """``n`` contiguous runs of the input with about equal bytes, cut only at line starts.

    Splittable segments are cut at the ``n - 1`` byte targets (moved forward to the next line
    start); every piece then goes to the part its midpoint falls in. Midpoints only grow along the
    input, so each part is a contiguous run and concatenating the parts restores the input order.
    """
    total = sum(s.nbytes for s in segments)
    targets = [total * k // n for k in range(1, n)]
    pieces: list[tuple[Segment, float]] = []
    offset = 0
    for seg in segments:
        start = seg.start
        if seg.file.splittable:
            for target in targets:
                local = seg.start + target - offset
                if start < local < seg.end:
                    cut = _next_cut(seg.file, local, seg.end)
                    if cut > start:
                        pieces.append((Segment(seg.file, start, cut), offset + (start + cut) / 2 - seg.start))
                        start = cut
        if start < seg.end or seg.nbytes == 0:
            pieces.append((Segment(seg.file, start, seg.end), offset + (start + seg.end) / 2 - seg.start))
        offset += seg.nbytes
    parts: list[list[Segment]] = [[] for _ in range(n)]
    for piece, middle in pieces:
        index = min(n - 1, int(middle * n // total)) if total else 0
        parts[index].append(piece)
    return parts


def _next_cut(f: InputFile, offset: int, limit: int) -> int:
    """Where a splittable file may be cut at or after ``offset`` (at most ``limit``)."""
    if f.layout is not None:
        return min(limit, f.layout.next_bound(offset))
    return _next_line_start(f.path, offset, limit)


def _next_line_start(path: str, offset: int, limit: int) -> int:
    """The first line start at or after ``offset`` (at most ``limit``)."""
    with open(path, "rb") as f:
        f.seek(offset - 1)
        pos = offset - 1
        while pos < limit:
            chunk = f.read(1 << 16)
            if not chunk:
                return limit
            newline = chunk.find(b"\n")
            if newline >= 0:
                return min(limit, pos + newline + 1)
            pos += len(chunk)
    return limit


def _lines_before(path: str, offset: int) -> int:
    """Newlines in the first ``offset`` bytes (only needed to name a bad line)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


def detect_rank() -> tuple[int, int, str]:
    """(rank, world size, source) when launched by mpirun/srun, else (0, 1, "single process").

    mpi4py answers under an MPI launcher when installed; otherwise the launcher's variables do.
    Slurm counts only inside an ``srun`` step (SLURM_STEP_NUM_TASKS): a batch script also sees
    SLURM_PROCID=0 and SLURM_NTASKS>1 while running a single copy.
    """
    env = os.environ
    if any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        try:
            from mpi4py import MPI

            return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), "mpi4py"
        except ImportError:
            pass
    for rank_var, size_var, source in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI environment"),
        ("PMI_RANK", "PMI_SIZE", "PMI environment"),
        ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "srun environment"),
    ):
        if rank_var in env and size_var in env:
            return int(env[rank_var]), int(env[size_var]), source
    return 0, 1, "single process"


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM (Slurm's time limit, ``kill``) into SystemExit so temporary outputs are removed."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def output_prefix(prefix: str, key: str) -> str:
    """Megatron-LM's naming: ``{prefix}_{key}_document``."""
    return f"{prefix}_{key}_document"


def rank_prefix(prefix: str, rank: int, world_size: int) -> str:
    """The per-rank shard prefix (zero-padded so shards sort by rank)."""
    return f"{prefix}-rank{rank:05d}-of-{world_size:05d}"


@dataclass
class PreprocessConfig:
    inputs: list[str]
    """Files or globs."""
    output_prefix: str
    """Outputs are ``{output_prefix}_{key}_document.bin/.idx``."""
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    """JSON fields to tokenize; one dataset per key. A record missing any of them is a bad line."""
    append_eod: bool = False
    """Append ``<|endoftext|>`` (100257) after every document."""
    workers: int = 1
    """Encoding processes in total."""
    partitions: int = 1
    """Independent reader/writer processes, each with ``workers // partitions`` workers."""
    log_interval: int | None = None
    """Print progress every this many documents (0: only the summary); None: every `log_seconds`."""
    log_seconds: float = 10.0
    """Print progress every this many seconds (a few lines for any corpus size), unless `log_interval`."""
    tokenizer_file: str | None = None
    """cl100k_base's BPE file (else $DIFFMEG_TOKENIZER_FILE)."""
    tokenizer_type: str = "cl100k_base"
    """cl100k_base, or HuggingFaceTokenizer (the folder `tokenizer_model`)."""
    tokenizer_model: str | None = None
    skip_bad_lines: bool = False
    """Skip (and count) malformed lines instead of stopping at the first."""
    overwrite: bool = False

    def __post_init__(self) -> None:
        if not self.inputs:
            raise DiffmegError("no --input given")
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise DiffmegError(f"--json-keys must name distinct keys, got {self.json_keys}")
        for key in self.json_keys:
            if not key or "/" in key or os.sep in key:
                raise DiffmegError(f"--json-keys {key!r} cannot be part of a file name")
        if self.workers < 1 or self.partitions < 1:
            raise DiffmegError("--workers and --partitions must be at least 1")
        if self.log_interval is not None and self.log_interval < 0:
            raise DiffmegError("--log-interval must be >= 0")
        check_output_prefix(self.output_prefix, extended=True)
        if not self.log_seconds > 0:
            raise DiffmegError(f"--log-seconds must be > 0, got {self.log_seconds}")


@dataclass
class PreprocessResult:
    outputs: dict[str, str]
    """key -> dataset prefix written."""
    documents: int = 0
    skipped: int = 0
    tokens: int = 0
    """Tokens written for the first key."""
    input_bytes: int = 0
    seconds: float = 0.0


def preprocess(
    cfg: PreprocessConfig, rank: int = 0, world_size: int = 1, log: Callable[[str], None] = stderr
) -> PreprocessResult:
    """Tokenize this rank's slice of ``cfg.inputs`` into its output datasets."""
    files = find_inputs(cfg.inputs)
    if not any(f.size for f in files):
        raise DiffmegError(
            f"--input {' '.join(cfg.inputs)}: every input file is empty (0 bytes), nothing to tokenize; "
            f"check the path (an unfinished download or copy?)"
        )
    if any(f.kind == "text" for f in files) and cfg.json_keys != ["text"]:
        raise DiffmegError("plain-text inputs carry only the 'text' field; drop --json-keys or use JSONL")
    for f in files:
        if f.layout is not None:
            tables.check_columns(f.path, f.layout, cfg.json_keys)
    base = cfg.output_prefix if world_size == 1 else rank_prefix(cfg.output_prefix, rank, world_size)
    prefixes = {key: output_prefix(base, key) for key in cfg.json_keys}
    check_can_write(prefixes.values(), cfg.overwrite)
    for prefix in prefixes.values():  # a loss mask left there would be read with the new tokens
        if has_loss_mask(prefix):
            raise DiffmegError(
                f"{loss_mask_prefix(prefix)}.bin/.idx is the loss mask of a dataset {prefix}, which "
                f"preprocessing writes none of; move it away first (or choose another --output-prefix)"
            )
    tag = tag_for(rank, world_size)
    remove_stale_temporaries(prefixes.values(), log=lambda line: log(tag + line))
    tokenizer = text_tokenizer(cfg)  # fail fast, before any process starts
    segments = split_segments([Segment(f, 0, f.size) for f in files], world_size)[rank]
    progress = _Progress(sum(s.nbytes for s in segments), cfg.log_interval, log, tag, cfg.log_seconds)
    start = time.time()
    if cfg.partitions == 1:
        with _Writers(prefixes) as writers:
            skipped = _encode_part(segments, writers, cfg, tokenizer, cfg.workers, progress.update)
            writers.commit(cfg if world_size == 1 else None, skipped)
    else:
        skipped, writers = _run_partitions(segments, prefixes, cfg, tokenizer, progress, world_size)
    record = record_of(tokenizer)
    for prefix in prefixes.values():  # which ids these are: training checks them against its tokenizer
        write_dataset_record(prefix, record)
    first = next(iter(writers.by_key.values()))  # what the first key's dataset holds (every key's documents)
    result = PreprocessResult(
        dict(prefixes), first.documents, skipped, first.tokens, progress.done_bytes, time.time() - start
    )
    log(
        f"{tag}done: {result.documents} documents, {result.tokens} tokens, "
        f"{result.input_bytes / 1e6:.1f} MB in {result.seconds:.1f} s "
        f"({result.documents / max(result.seconds, 1e-9):.0f} docs/s, "
        f"{result.tokens / max(result.seconds, 1e-9):.0f} tokens/s)"
        + (f"; skipped {result.skipped} bad lines" if cfg.skip_bad_lines else "")
    )
    for prefix in prefixes.values():
        log(f"{tag}wrote {prefix}.bin/.idx ({record.describe()})")
    return result


def text_tokenizer(cfg: PreprocessConfig):
    """The tokenizer of `cfg` (cl100k_base or a Hugging Face folder; `null` reads no text)."""
    from diffmeg.data.tokenizers import NULL, build_tokenizer

    if cfg.tokenizer_type == NULL:
        raise DiffmegError("--tokenizer-type null reads token ids; preprocessing text needs a tokenizer")
    return build_tokenizer(
        cfg.tokenizer_type, tokenizer_file=cfg.tokenizer_file, tokenizer_model=cfg.tokenizer_model
    )


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Documents as stored (before the end-of-document id): cl100k_base's plain encoding (no special
    tokens), a Hugging Face tokenizer's encoding with its special tokens (e.g. Llama's `<s>` first)."""
    encode_documents = getattr(tokenizer, "encode_documents", None)
    if encode_documents is not None:
        return encode_documents(texts)
    return [tokenizer.encoding.encode_ordinary(text) for text in texts]


def tag_for(rank: int, world_size: int) -> str:
    """The prefix of this rank's log lines (none in a single process)."""
    return f"[rank {rank}/{world_size}] " if world_size > 1 else ""


class _Writers:
    """One IndexedWriter per key, committed together; a full disk raises ``DiskFullError``."""

    def __init__(self, prefixes: dict[str, str], extra_written: Callable[[], int] | None = None) -> None:
        self.by_key: dict[str, IndexedWriter] = {}
        self.directory = os.path.dirname(os.path.abspath(next(iter(prefixes.values()))))
        self.extra_written = extra_written
        try:
            for key, prefix in prefixes.items():
                self.by_key[key] = IndexedWriter(prefix)
        except BaseException:
            self.abort()
            raise

    def commit(self, cfg: PreprocessConfig | None = None, skipped: int = 0) -> None:
        """Move the outputs into place; with `cfg` (the whole output, not a rank's shard or a partition,
        which may be empty), only if they hold a document: a dataset of nothing would fail training much
        later, and would have replaced a previous output."""
        if cfg is not None and next(iter(self.by_key.values())).documents == 0:
            raise DiffmegError(
                f"--input {' '.join(cfg.inputs)} holds no documents ({skipped} bad lines skipped); "
                f"nothing written: check the input and --json-keys"
            )
        eods = cfg is not None and cfg.append_eod
        empty = [k for k, w in self.by_key.items() if w.tokens == (w.documents if eods else 0)]
        if cfg is not None and empty:
            documents = next(iter(self.by_key.values())).documents
            raise DiffmegError(
                f"--input {' '.join(cfg.inputs)} holds {documents} documents whose {empty[0]!r} texts are "
                f"all empty (0 tokens); nothing written: check that --json-keys names the field with the text"
            )
        for writer in self.by_key.values():
            writer.commit()

    def abort(self) -> None:
        for writer in self.by_key.values():
            writer.abort()

    def __enter__(self) -> _Writers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        abort_writers(list(self.by_key.values()), exc, self.directory, self.extra_written)


class _Progress:
    """Documents/s, MB/s of stored input and an ETA, every ``interval`` documents, or (``interval`` None)
    every ``seconds``: a line per N documents is thousands of lines for a real corpus."""

    def __init__(
        self,
        total_bytes: int,
        interval: int | None,
        log: Callable[[str], None],
        tag: str,
        seconds: float = 10.0,
    ) -> None:
        self.total_bytes, self.interval, self.log, self.tag = total_bytes, interval, log, tag
        self.seconds = seconds
        self.docs = self.done_bytes = 0
        self.start = self._last = time.time()
        self._next = interval or 0

    def _due(self) -> bool:
        if self.interval is None:
            return time.time() - self._last >= self.seconds
        if self.interval and self.docs >= self._next:
            self._next = (self.docs // self.interval + 1) * self.interval
            return True
        return False

    def update(self, docs: int, nbytes: int) -> None:
        self.docs += docs
        self.done_bytes += nbytes
        if self._due():
            self._last = time.time()
            elapsed = max(time.time() - self.start, 1e-9)
            rate = self.done_bytes / elapsed
            left = max(self.total_bytes - self.done_bytes, 0)
            eta = time.strftime("%H:%M:%S", time.gmtime(left / rate)) if rate > 0 else "?"
            pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
            self.log(
                f"{self.tag}processed {self.docs} documents ({self.docs / elapsed:.0f} docs/s, "
                f"{rate / 1e6:.2f} MB/s), {pct:.1f}% of input, ETA {eta}"
            )


# ----- reading -------------------------------------------------------------------------------
# A batch: (segment number, 1-based line of its first record within the segment, kind,
# records as bytes, stored bytes it covers); a table's: the row of the file (from 0) of its first record,
# "table", records as tuples of the --json-keys columns' values.
_Batch = tuple[int, int, str, list[bytes] | list[tuple], int]


def _open_stream(raw: io.BufferedReader, f: InputFile) -> io.BufferedIOBase:
    if f.compression == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if f.compression == "zst":
        try:
            import zstandard
        except ImportError:
            raise DiffmegError(
                f"{f.path}: reading .zst needs the zstandard package (pip install zstandard)"
            ) from None
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return raw


def _iter_batches(segments: list[Segment], keys: list[str]) -> Iterator[_Batch]:
    for number, seg in enumerate(segments):
        f = seg.file
        if f.layout is not None:
            for first, rows, nbytes in tables.read_rows(
                f.path, f.layout, seg.start, seg.end, keys, BATCH_BYTES
            ):
                yield number, first, "table", rows, nbytes
            continue
        try:
            with open(f.path, "rb") as raw:
                raw.seek(seg.start)
                stream = _open_stream(raw, f)
                if f.kind == "text":
                    yield number, 1, "text", [stream.read()], seg.nbytes
                    continue
                lines: list[bytes] = []
                size, first, pos, reported = 0, 1, seg.start, seg.start
                for line in stream:
                    lines.append(line)
                    size += len(line)
                    pos += len(line)
                    done = not f.compression and pos >= seg.end
                    if size >= BATCH_BYTES or done:
                        now = pos if not f.compression else min(raw.tell(), seg.end)
                        yield number, first, "jsonl", lines, now - reported
                        first, lines, size, reported = first + len(lines), [], 0, now
                    if done:
                        break
                yield number, first, "jsonl", lines, seg.end - reported
        except (OSError, EOFError) as exc:
            raise DiffmegError(f"cannot read {f.path}: {exc}") from None


# ----- encoding (runs in worker processes, or inline) ---------------------------------------
_WORKER: dict = {}


def _init_worker_process(tokenizer, keys: list[str], append_eod: bool, parent: int) -> None:
    # Ctrl-C and termination are handled by the parent, which terminates the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent)
    _init_worker(tokenizer, keys, append_eod)


def die_with_parent(parent: int) -> None:
    """Get SIGTERM when the parent process dies (Linux), so a SIGKILLed run leaves no workers behind.

    Orphaned pool workers would otherwise wait forever on a queue whose other end they hold themselves.
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _init_worker(tokenizer, keys: list[str], append_eod: bool) -> None:
    # Forked workers inherit the tokenizer; spawned ones get it pickled (it reloads from its file).
    _WORKER.update(tokenizer=tokenizer, keys=keys, append_eod=append_eod)


def _encode_batch(batch: _Batch) -> tuple[int, int, list[tuple[int, str]], dict, int]:
    """Parse and tokenize one batch; returns its bad lines instead of raising on them."""
    number, first, kind, records, nbytes = batch
    tokenizer, keys, append_eod = _WORKER["tokenizer"], _WORKER["keys"], _WORKER["append_eod"]
    ids: dict[str, list[int]] = {k: [] for k in keys}
    lengths: dict[str, list[int]] = {k: [] for k in keys}
    texts_by_key: dict[str, list[str]] = {k: [] for k in keys}
    bad: list[tuple[int, str]] = []
    for offset, record in enumerate(records):
        texts = _texts(record, kind, keys, first + offset, bad)
        if texts is None:
            continue
        for key, text in zip(keys, texts, strict=True):
            texts_by_key[key].append(text)
    for key in keys:
        for tokens in encode_texts(tokenizer, texts_by_key[key]):
            if append_eod:
                tokens.append(tokenizer.eod)
            ids[key].extend(tokens)
            lengths[key].append(len(tokens))
    arrays = {k: (np.array(ids[k], dtype=np.int32), np.array(lengths[k], dtype=np.int64)) for k in keys}
    return number, first, bad, arrays, nbytes


def _texts(record: bytes | tuple, kind: str, keys: list[str], line: int, bad: list) -> list[str] | None:
    if kind == "table":
        texts, reason = tables.row_texts(record, keys)
        if texts is None:
            bad.append((line, reason))
        return texts
    if kind == "text":
        try:
            return [record.decode("utf-8")]
        except UnicodeDecodeError as exc:
            bad.append((line, f"not valid UTF-8 at byte {exc.start}"))
            return None
    if not record.strip():
        return None  # blank line: not a record
    try:
        obj = json.loads(record)
    except UnicodeDecodeError as exc:
        bad.append((line, f"not valid UTF-8 at byte {exc.start}"))
        return None
    except ValueError as exc:
        bad.append(
            (line, f"invalid JSON ({getattr(exc, 'msg', exc)} at column {getattr(exc, 'colno', '?')})")
        )
        return None
    if not isinstance(obj, dict):
        bad.append((line, f"expected a JSON object, got {type(obj).__name__}"))
        return None
    texts = []
    for key in keys:
        if key not in obj:
            bad.append((line, f"missing key {key!r}"))
            return None
        if not isinstance(obj[key], str):
            bad.append((line, f"key {key!r} is {type(obj[key]).__name__}, not a string"))
            return None
        texts.append(obj[key])
    return texts


def _ordered_map(pool, fn, items: Iterable, max_in_flight: int) -> Iterator:
    """Like ``pool.imap`` but reads ahead only ``max_in_flight`` items (imap reads everything)."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _mp_context() -> mp.context.BaseContext:
    # fork: workers inherit the loaded tokenizer and imports instead of redoing ~3 s of imports
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _encode_part(
    segments: list[Segment],
    writers: _Writers,
    cfg: PreprocessConfig,
    tokenizer,
    workers: int,
    report: Callable[[int, int], None],
) -> int:
    """Encode ``segments`` in order into ``writers``; returns the number of skipped lines."""
    init_args = (tokenizer, cfg.json_keys, cfg.append_eod)
    skipped = 0
    pool = None
    try:
        if workers > 1:
            pool = _mp_context().Pool(
                workers, initializer=_init_worker_process, initargs=(*init_args, os.getpid())
            )
            batches = _iter_batches(segments, cfg.json_keys)
            results = _ordered_map(pool, _encode_batch, batches, 2 * workers + 2)
        else:
            _init_worker(*init_args)
            results = map(_encode_batch, _iter_batches(segments, cfg.json_keys))
        for number, _first, bad, arrays, nbytes in results:
            if bad:
                if not cfg.skip_bad_lines:
                    seg = segments[number]
                    line, reason = bad[0]
                    if seg.file.layout is not None:
                        where = seg.file.layout.where(line)
                        raise DiffmegError(
                            f"{seg.file.path}: {where}: {reason}; fix it or pass --skip-bad-lines"
                        )
                    line += _lines_before(seg.file.path, seg.start) if seg.start else 0
                    raise DiffmegError(f"{seg.file.path}:{line}: {reason}; fix it or pass --skip-bad-lines")
                skipped += len(bad)
            for key, writer in writers.by_key.items():
                writer.add_documents(*arrays[key])
            report(len(arrays[cfg.json_keys[0]][1]), nbytes)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return skipped


# ----- partitions -----------------------------------------------------------------------------
def _run_partitions(
    segments: list[Segment],
    prefixes: dict[str, str],
    cfg: PreprocessConfig,
    tokenizer,
    progress: _Progress,
    world_size: int = 1,
) -> tuple[int, _Writers]:
    """Encode ``cfg.partitions`` slices in parallel processes into scratch shards, then merge: the lines
    skipped, and the committed writers."""
    parts = split_segments(segments, cfg.partitions)
    workers = max(1, cfg.workers // cfg.partitions)
    first = next(iter(prefixes.values()))
    # Named after our process id, so a later run can tell a killed run's scratch from a live one's.
    out_dir = os.path.dirname(os.path.abspath(first))
    scratch = tempfile.mkdtemp(prefix=f"{os.path.basename(first)}.tmp-{os.getpid()}-", dir=out_dir)
    ctx = _mp_context()
    messages = ctx.Queue()
    procs = []
    try:
        part_prefixes = [
            {key: os.path.join(scratch, f"part{i:05d}_{key}") for key in prefixes} for i in range(len(parts))
        ]
        for i, part in enumerate(parts):
            args = (i, part, part_prefixes[i], cfg, tokenizer, workers, messages, os.getpid())
            procs.append(ctx.Process(target=_partition_main, args=args, daemon=False))
            procs[-1].start()
        skipped, pending = 0, set(range(len(parts)))
        while pending:
            try:
                message = messages.get(timeout=0.5)
            except queue.Empty:
                for i in pending:
                    if procs[i].exitcode not in (None, 0):
                        raise DiffmegError(f"partition {i} died with exit code {procs[i].exitcode}") from None
                continue
            if message[0] == "progress":
                progress.update(message[1], message[2])
            elif message[0] == "done":
                pending.discard(message[1])
                skipped += message[2]
            elif message[0] == "diskfull":  # the bytes it removed, plus what the others hold now
                raise DiskFullError(out_dir, message[2] + directory_bytes(scratch))
            else:
                raise DiffmegError(message[2])
        for proc in procs:
            proc.join()
        with _Writers(prefixes, extra_written=lambda: directory_bytes(scratch)) as writers:
            for key, writer in writers.by_key.items():
                for part in part_prefixes:
                    writer.add_dataset(part[key])
            writers.commit(cfg if world_size == 1 else None, skipped)
        return skipped, writers
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
        shutil.rmtree(scratch, ignore_errors=True)


def _partition_main(
    index: int,
    segments: list[Segment],
    prefixes: dict[str, str],
    cfg: PreprocessConfig,
    tokenizer,
    workers: int,
    messages,
    parent: int,
) -> None:
    die_with_parent(parent)
    try:
        with _Writers(prefixes) as writers:
            report = lambda docs, nbytes: messages.put(("progress", docs, nbytes))
            skipped = _encode_part(segments, writers, cfg, tokenizer, workers, report)
            writers.commit()
        messages.put(("done", index, skipped))
    except DiskFullError as exc:
        messages.put(("diskfull", index, exc.written))
    except DiffmegError as exc:
        messages.put(("error", index, str(exc)))
    except (KeyboardInterrupt, SystemExit):
        pass  # the parent is stopping us; the writers have removed their files
    except BaseException as exc:
        traceback.print_exc()
        messages.put(("error", index, f"partition {index} failed: {type(exc).__name__}: {exc}"))
