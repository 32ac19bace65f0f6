"""safetensors files read and written one tensor at a time, with plain file I/O.

The format: an 8-byte little-endian header length N, N bytes of JSON
(`{"__metadata__": {...}, name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}}`, padded
with spaces), then the data (offsets relative to its start, no gaps).

Why not the `safetensors` package: its reader memory-maps each file, and every tensor read stays resident
(file pages counted in the process's RSS) until the file is closed, so reading a model through it costs
the model's size; its writer needs every tensor of a file in memory at once, and creates files readable
by their owner only (0600, whatever the umask). Here a read seeks and reads one tensor's bytes into a
fresh tensor; the writer plans the files from the tensors' names, shapes and dtypes, writes each header
first and each tensor's bytes as it arrives, and creates files as `open()` does (the umask applies).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from diffmeg.errors import DiffmegError
from diffmeg.storage import write_json

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100_000_000  # the safetensors package's own limit
INDEX_FILE = "model.safetensors.index.json"


def _check_byteorder() -> None:
    if sys.byteorder != "little":
        raise DiffmegError("safetensors data is little-endian; this machine is big-endian")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are (relative to the data section) and what they hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One .safetensors file: its header parsed once, tensors read on demand (no memory map)."""

    def __init__(self, path: str) -> None:
        _check_byteorder()
        self.path = path
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise ValueError("file shorter than its 8-byte header length")
                (length,) = struct.unpack("<Q", head)
                if length > _MAX_HEADER:
                    raise ValueError(f"header length {length} is implausible")
                header = json.loads(f.read(length))
            self.data_start = 8 + length
            size = os.path.getsize(path)
        except (OSError, ValueError) as exc:
            raise DiffmegError(f"{path} is not a readable safetensors file: {exc}") from None
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if entry.get("dtype") not in DTYPES:
                raise DiffmegError(
                    f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, not supported here"
                )
            begin, end = (int(x) for x in entry["data_offsets"])
            info = TensorInfo(DTYPES[entry["dtype"]], tuple(int(s) for s in entry["shape"]), begin, end)
            if info.nbytes != math.prod(info.shape) * info.dtype.itemsize or self.data_start + end > size:
                raise DiffmegError(f"{path}: tensor {name!r} does not fit its header (truncated file?)")
            self.tensors[name] = info

    def read(self, name: str) -> torch.Tensor:
        """The tensor, read now into memory of its own."""
        info = self.tensors[name]
        flat = torch.empty(info.nbytes, dtype=torch.uint8)
        view = memoryview(flat.numpy())
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + info.begin)
            done = 0
            while done < info.nbytes:
                count = f.readinto(view[done:])
                if not count:
                    raise DiffmegError(f"{self.path}: unexpected end of file reading {name!r}")
                done += count
        return flat.view(info.dtype).reshape(info.shape)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Shard:
    """One planned file: its header is known before any tensor arrives."""

    def __init__(self, path: str, tensors: list[PlannedTensor]) -> None:
        self.path = path
        # Largest element size first keeps every tensor aligned to its element size.
        ordered = sorted(tensors, key=lambda t: -t.dtype.itemsize)
        header: dict = {"__metadata__": {"format": "pt"}}
        self.offsets: dict[str, int] = {}
        self.planned = {t.name: t for t in tensors}
        offset = 0
        for t in ordered:
            header[t.name] = {
                "dtype": _NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            self.offsets[t.name] = offset
            offset += t.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.header = struct.pack("<Q", len(text)) + text
        self.remaining = set(self.planned)
        self._file = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._file is None:
            self._file = open(self.path, "wb")  # noqa: SIM115 - closed when its last tensor is written
            self._file.write(self.header)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.seek(len(self.header) + self.offsets[name])
        self._file.write(memoryview(data))
        self.remaining.discard(name)
        if not self.remaining:
            self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


class SafetensorsShardWriter:
    """`model-XXXXX-of-YYYYY.safetensors` shards and their index, written tensor by tensor.

    The plan (every tensor's name, shape and dtype, in the order they will come) fixes the shards up front
    (a new shard starts where the next tensor would pass `max_shard_bytes`), so each tensor is written
    into its file as soon as `add` receives it and nothing is held back: memory is one tensor.
    """

    def __init__(
        self, directory: str, max_shard_bytes: int, plan: Iterable[tuple[str, tuple[int, ...], torch.dtype]]
    ) -> None:
        _check_byteorder()
        if max_shard_bytes <= 0:
            raise DiffmegError(f"max shard size must be > 0, got {max_shard_bytes}")
        planned = [PlannedTensor(name, tuple(shape), dtype) for name, shape, dtype in plan]
        groups: list[list[PlannedTensor]] = []
        size = 0
        for t in planned:
            if not groups or (groups[-1] and size + t.nbytes > max_shard_bytes):
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += t.nbytes
        count = len(groups)
        self.directory = directory
        self.names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self._shards = [
            _Shard(os.path.join(directory, n), g) for n, g in zip(self.names, groups, strict=True)
        ]
        self._where = {t.name: shard for shard in self._shards for t in shard.planned.values()}
        if len(self._where) != len(planned):
            raise DiffmegError("the shard plan names a tensor twice")
        self.total_bytes = sum(t.nbytes for t in planned)

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            shard = self._where.get(name)
            if shard is None or name not in shard.remaining:
                raise DiffmegError(f"tensor {name!r} is not in the shard plan or was written already")
            planned = shard.planned[name]
            if tuple(tensor.shape) != planned.shape or tensor.dtype != planned.dtype:
                raise DiffmegError(
                    f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, the plan says "
                    f"{planned.dtype} {list(planned.shape)}"
                )
            shard.write(name, tensor)

    def close(self) -> list[str]:
        """Check every planned tensor arrived, write model.safetensors.index.json; returns the shard names."""
        for shard in self._shards:
            if shard.remaining:
                raise DiffmegError(f"tensor {sorted(shard.remaining)[0]!r} was planned but never written")
        weight_map = {name: os.path.basename(shard.path) for name, shard in self._where.items()}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(os.path.join(self.directory, INDEX_FILE), index)
        return list(self.names)

    def abort(self) -> None:
        """Close open files (after a failure; the caller removes the directory)."""
        for shard in self._shards:
            if shard._file is not None:
                shard._file.close()
                shard._file = None
