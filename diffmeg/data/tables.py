"""Columnar inputs of preprocessing: Parquet files, Arrow files, `datasets` folders (``save_to_disk``) and
datasets of the local Hugging Face cache (``hf:NAME[:SPLIT]``).

A table is read one *unit* at a time, a Parquet row group or an Arrow record batch, and only the columns
that are tokenized, so a 10 GB shard never sits in memory. Units are also where the input may be cut
between ranks, partitions and workers: a table's coordinates are its units' stored bytes laid end to end
(`TableLayout.bounds`), the byte-offset view preprocess.py's segments use for JSON lines.
"""

from __future__ import annotations

import bisect
import importlib
import itertools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

from diffmeg.errors import DiffmegError

TABLE_SUFFIXES = (".parquet", ".arrow")
_ARROW_FILE_MAGIC = b"ARROW1"


@dataclass(frozen=True)
class TableLayout:
    """Where a table's units lie: unit i holds ``rows[i]`` rows and covers ``[bounds[i], bounds[i + 1])``."""

    format: str
    """"parquet", "arrow-file" (Arrow IPC file, random access) or "arrow-stream" (IPC stream: `datasets`)."""
    columns: tuple[str, ...]
    rows: tuple[int, ...]
    bounds: tuple[int, ...]

    @property
    def unit(self) -> str:
        return "row group" if self.format == "parquet" else "record batch"

    @cached_property
    def _row_starts(self) -> tuple[int, ...]:
        """The file's row (from 0) where each unit starts; a datasets Arrow file has thousands of units."""
        return tuple(itertools.accumulate(self.rows, initial=0))

    def next_bound(self, offset: int) -> int:
        """The first unit boundary at or after ``offset``: where a slice of the table may start."""
        return self.bounds[min(bisect.bisect_left(self.bounds, offset), len(self.bounds) - 1)]

    def units(self, start: int, end: int) -> range:
        """The units covering ``[start, end)`` (both unit boundaries)."""
        return range(bisect.bisect_left(self.bounds, start), bisect.bisect_left(self.bounds, end))

    def first_row(self, unit: int) -> int:
        return self._row_starts[unit]

    def where(self, row: int) -> str:
        """A row of the file (counted from 0) as its unit and its row within it."""
        unit = bisect.bisect_right(self._row_starts, row) - 1  # the last unit starting there: not empty
        return f"{self.unit} {unit}, row {row - self._row_starts[unit]} (counted from 0)"


def _require(module: str, what: str) -> None:
    """One line, not an ImportError, where the optional package that reads tables is missing."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise DiffmegError(
            f"{what} needs the {module} package: pip install 'diffmeg[tables]' (or pip install {module})"
        ) from None


def _reason(exc: BaseException) -> str:
    """pyarrow's message, on one line."""
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__


def _arrow_format(path: str) -> str:
    with open(path, "rb") as f:
        return "arrow-file" if f.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC else "arrow-stream"


def read_layout(path: str) -> TableLayout:
    """The units of the Parquet or Arrow file ``path``, from its metadata (Parquet's footer) or by walking its
    batches over a memory map (an Arrow stream has no footer; no data is copied)."""
    _require("pyarrow", f"--input {path}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.lower().endswith(".parquet"):
        try:
            meta = pq.ParquetFile(path).metadata
        except (pa.ArrowException, OSError) as exc:
            raise DiffmegError(
                f"--input {path} cannot be read as Parquet: its footer is damaged or the file is cut short "
                f"({_reason(exc)}); download or copy it again"
            ) from None
        groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
        sizes = [sum(g.column(c).total_compressed_size for c in range(g.num_columns)) for g in groups]
        return _layout("parquet", meta.schema.to_arrow_schema().names, [g.num_rows for g in groups], sizes)
    fmt = _arrow_format(path)
    rows: list[int] = []
    sizes: list[int] = []
    try:
        with pa.memory_map(path) as source:
            if fmt == "arrow-file":
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    rows.append(batch.num_rows)
                    sizes.append(batch.nbytes)
            else:
                reader = pa.ipc.open_stream(source)
                for batch in reader:
                    rows.append(batch.num_rows)
                    sizes.append(batch.nbytes)
            names = reader.schema.names
    except (pa.ArrowException, OSError) as exc:
        where = f"record batch {len(rows)}" if rows else "its header"
        raise DiffmegError(
            f"--input {path}: {where} cannot be read as Arrow ({_reason(exc)}); the file is damaged or cut "
            f"short: write or copy it again"
        ) from None
    return _layout(fmt, names, rows, sizes)


def _layout(fmt: str, columns: list[str], rows: list[int], sizes: list[int]) -> TableLayout:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + max(int(size), 1))  # a unit is never empty in bytes: bounds stay distinct
    return TableLayout(fmt, tuple(columns), tuple(rows), tuple(bounds))


def check_columns(path: str, layout: TableLayout, keys: list[str]) -> None:
    """One line naming the columns there are, before any work, when a --json-keys column is not one."""
    missing = [key for key in keys if key not in layout.columns]
    if missing:
        raise DiffmegError(
            f"--input {path} has no column {missing[0]!r} (its columns: {', '.join(layout.columns)}); "
            f"pass --json-keys with the column that holds the text"
        )


def read_rows(
    path: str, layout: TableLayout, start: int, end: int, keys: list[str], batch_bytes: int
) -> Iterator[tuple[int, list[tuple], int]]:
    """The rows of ``[start, end)`` as (row of the file of the first one, rows as tuples of the ``keys``
    columns' values, stored bytes covered), about ``batch_bytes`` of text at a time, one unit in memory."""
    for unit, table in _read_units(path, layout, start, end, keys):
        first, nbytes = layout.first_row(unit), layout.bounds[unit + 1] - layout.bounds[unit]
        n = table.num_rows
        step = max(1, n * batch_bytes // max(table.nbytes, 1))
        reported = 0
        for offset in range(0, max(n, 1), step):
            part = table.slice(offset, step)
            columns = [part.column(key).to_pylist() for key in keys]
            covered = nbytes * min(offset + step, n) // n if n else nbytes
            yield first + offset, list(zip(*columns, strict=True)), covered - reported
            reported = covered


def _read_units(path: str, layout: TableLayout, start: int, end: int, keys: list[str]) -> Iterator:
    """(unit, table of the ``keys`` columns) for each unit of ``[start, end)``; a unit that cannot be read
    is one line naming the file and the unit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    units = layout.units(start, end)
    if not units:
        return
    unit = units.start
    try:
        if layout.format == "parquet":
            with pq.ParquetFile(path) as f:
                for unit in units:
                    yield unit, f.read_row_group(unit, columns=list(keys))
            return
        with pa.memory_map(path) as source:
            if layout.format == "arrow-file":
                reader = pa.ipc.open_file(source)
                for unit in units:
                    yield unit, pa.Table.from_batches([reader.get_batch(unit)]).select(list(keys))
                return
            stream = iter(pa.ipc.open_stream(source))
            for unit in range(units.stop):  # the batches before ours: zero-copy skips over the map
                batch = next(stream)
                if unit >= units.start:
                    yield unit, pa.Table.from_batches([batch]).select(list(keys))
    except (pa.ArrowException, OSError, StopIteration) as exc:
        raise DiffmegError(
            f"{path}: {layout.unit} {unit} cannot be read ({_reason(exc)}); the file is damaged: download or "
            f"copy it again"
        ) from None


def row_texts(values: tuple, keys: list[str]) -> tuple[list[str] | None, str]:
    """A row's texts, or None and why the row is bad (a null or a value that is not a string)."""
    for key, value in zip(keys, values, strict=True):
        if value is None:
            return None, f"column {key!r} is null"
        if not isinstance(value, str):
            return None, f"column {key!r} is {type(value).__name__}, not a string"
    return list(values), ""


# ----- folders and the Hugging Face cache ----------------------------------------------------------
def saved_dataset_files(folder: str) -> list[str] | None:
    """The Arrow files of a ``datasets.Dataset.save_to_disk`` folder, in its order (state.json's
    ``_data_files``); None for a folder that is not one. A DatasetDict's folder is refused in one line."""
    dict_file = os.path.join(folder, "dataset_dict.json")
    if os.path.isfile(dict_file):
        try:
            with open(dict_file) as f:
                splits = list(json.load(f)["splits"])
        except (OSError, ValueError, KeyError, TypeError):
            splits = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
        example = os.path.join(folder, splits[0] if splits else "train")
        raise DiffmegError(
            f"--input {folder} is a DatasetDict (splits: {', '.join(splits) or 'none'}); pass one split's "
            f"folder, e.g. --input {example}"
        )
    state_file = os.path.join(folder, "state.json")
    if not os.path.isfile(state_file):
        return None
    try:
        with open(state_file) as f:
            names = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DiffmegError(
            f"--input {folder}: its state.json does not list the data files ({type(exc).__name__}: {exc}); "
            f"save the dataset again with save_to_disk"
        ) from None
    files = [os.path.join(folder, name) for name in names]
    for path in files:
        if not os.path.isfile(path):
            raise DiffmegError(
                f"--input {folder}: state.json lists {os.path.basename(path)}, which is not there; copy the "
                f"whole folder again"
            )
    return files


def describe_folder(folder: str, supported: str) -> str:
    """What to pass instead of a folder that is not a saved dataset: a glob of the files it holds."""
    counts: dict[str, int] = {}
    for name in sorted(os.listdir(folder)):
        for suffix in (*TABLE_SUFFIXES, ".jsonl", ".json", ".txt", ".jsonl.gz", ".jsonl.zst"):
            if name.lower().endswith(suffix) and os.path.isfile(os.path.join(folder, name)):
                counts[suffix] = counts.get(suffix, 0) + 1
    if not counts:
        return f"--input {folder} is a folder holding no input file; pass files or a glob ({supported})"
    suffix = max(counts, key=lambda s: (counts[s], s == ".parquet"))
    return (
        f"--input {folder} is a folder of {counts[suffix]} {suffix} files; pass a glob such as "
        f"'{folder.rstrip('/')}/*{suffix}'"
    )


def parse_hf(spec: str) -> tuple[str, str | None, str]:
    """``hf:NAME[:SPLIT]`` or ``hf:NAME:CONFIG:SPLIT`` as (name, config, split); the split defaults to
    train."""
    parts = spec[len("hf:") :].split(":")
    if not parts[0] or len(parts) > 3 or not all(parts):
        raise DiffmegError(f"--input {spec}: expected hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    return parts[0], None, parts[1] if len(parts) == 2 else "train"


@contextmanager
def _offline() -> Iterator[None]:
    """`datasets` and `huggingface_hub` without network for one call: their flags are read at import, so
    they are set in the environment (for a first import) and in their config (for an earlier one)."""
    saved = {var: os.environ.get(var) for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    import datasets
    import huggingface_hub.constants as hub_constants

    flags = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE")]
    flags.append((hub_constants, "HF_HUB_OFFLINE"))
    old = [getattr(module, name, None) for module, name in flags]
    verbosity = datasets.logging.get_verbosity()
    for module, name in flags:
        setattr(module, name, True)
    datasets.logging.set_verbosity_error()  # "Using the latest cached version ..." on every run
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        for (module, name), value in zip(flags, old, strict=True):
            setattr(module, name, value)
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def hf_cached_files(spec: str) -> list[str]:
    """The Arrow files of ``hf:NAME[:SPLIT]`` in the local Hugging Face cache, never downloading."""
    name, config, split = parse_hf(spec)
    _require("datasets", f"--input {spec}")
    with _offline():
        import datasets

        cache = datasets.config.HF_DATASETS_CACHE
        call = f"datasets.load_dataset('{name}'{f', {config!r}' if config else ''}, split='{split}')"
        try:
            ds = datasets.load_dataset(name, config, split=split)
        except ValueError as exc:  # the dataset is there, the split or config is not
            raise DiffmegError(f"--input {spec}: {_reason(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - datasets raises ConnectionError, FileNotFoundError, its own
            raise DiffmegError(
                f"--input {spec}: not in the local Hugging Face cache ({cache}; {type(exc).__name__}) and "
                f'nothing is downloaded here; cache it on a node with network: python3 -c "import datasets; '
                f'{call}" (same HF_HOME), or save_to_disk it and pass that folder'
            ) from None
    if not isinstance(ds, datasets.Dataset) or ds._indices is not None or not ds.cache_files:
        raise DiffmegError(
            f"--input {spec}: the cached dataset has no plain Arrow files to read; save_to_disk it and pass "
            f"that folder"
        )
    return [entry["filename"] for entry in ds.cache_files]
