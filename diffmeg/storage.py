"""Disk-space facts shared by every writer (checkpoints, datasets, conversions).

Each writer turns a full disk or quota into one line naming the directory and its free space, and
removes what it left half-written; these helpers answer the questions that line needs. `check_output`
is the one check of an output path before work starts (every tool's --save, --output-prefix,
--tensorboard-dir, --metrics-file): a read-only file system, a path without permission, a file where a
folder should be (or the reverse) and too little space, each named as what it is. `default_cache_dir` is
where diffmeg keeps what it can rebuild. `atomic_write` is how a file is written whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Iterator
from typing import IO, Any

from diffmeg.errors import DiffmegError

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
CACHE_DIR_ENV = "DIFFMEG_CACHE_DIR"


def default_cache_dir() -> str:
    """Where diffmeg caches what it can rebuild (the builtin corpus, token-id ranges of read-only data):
    ``$DIFFMEG_CACHE_DIR``, else ``~/.cache/diffmeg``."""
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "diffmeg")


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", **open_kwargs: Any) -> Iterator[IO]:
    """`path` opened at a temporary beside it, renamed to `path` when the block ends without error: a crash,
    a full disk or Ctrl-C leaves the previous file whole and no temporary."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def write_json(path: str, data: Any, *, indent: int = 2, **dump_kwargs: Any) -> None:
    """`data` as indented JSON and a newline, written atomically."""
    with atomic_write(path) as f:
        json.dump(data, f, indent=indent, **dump_kwargs)
        f.write("\n")


def format_bytes(n: float) -> str:
    """`n` bytes for a message: 512 B, 20.1 MiB, 3.2 GiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def free_bytes(path: str) -> int:
    """Free bytes for this user on the file system holding `path` (or its nearest existing parent);
    -1 when the file system cannot be asked."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return -1


def directory_bytes(path: str) -> int:
    """Bytes of the files under `path` (0 if it does not exist): what a failed writer had written."""
    total = 0
    for directory, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(directory, name))
            except OSError:
                pass
    return total


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the per-rank failures a torch.distributed.checkpoint
    CheckpointException carries (values are exceptions or (exception, traceback) tuples)."""
    seen: set[int] = set()
    todo: list = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def is_disk_full(exc: BaseException) -> bool:
    """An ENOSPC/EDQUOT anywhere in `exc`'s chain. torch's zip writer reports a full disk as "unexpected
    pos", without errno: callers that can also compare the free space with what they meant to write."""
    return any(
        isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS or "No space left on device" in str(e)
        for e in _exception_chain(exc)
    )


def paths_overlap(a: str, b: str) -> bool:
    """Whether two paths are the same folder or one lies inside the other (symlinks resolved): an output
    that would be written into its own source, or around it."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_output(path: str, flag: str, *, folder: bool, needed_bytes: int | None = None) -> None:
    """`path` can be written as a folder (`folder`) or a file, creating what is missing of it; else one
    line naming `flag`, the path and what is wrong. Creates nothing. `needed_bytes`: the room it needs."""
    path = os.path.abspath(path)
    kind = "folder" if folder else "file"
    if os.path.exists(path):
        if folder and not os.path.isdir(path):
            raise DiffmegError(f"{flag} {path} is a file, not a folder; remove it or choose another {flag}")
        if not folder and os.path.isdir(path):
            raise DiffmegError(f"{flag} {path} is a folder, not a file; give a file name inside it")
    base = path if os.path.isdir(path) else os.path.dirname(path)
    while not os.path.exists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        raise DiffmegError(f"{flag} {path}: {base} is a file, so the {kind} cannot be made under it")
    target = path if os.path.exists(path) and not folder else base
    if _read_only(target):
        raise DiffmegError(f"{flag} {path} is on a read-only file system ({base}); choose another {flag}")
    if not os.access(target, os.W_OK | (os.X_OK if os.path.isdir(target) else 0)):
        raise DiffmegError(f"{flag} {path}: no permission to write in {target}; choose another {flag}")
    if needed_bytes is not None:
        free = free_bytes(base)
        if 0 <= free < needed_bytes:
            raise DiffmegError(
                f"{flag} {path}: {base} has {format_bytes(free)} free but this writes about "
                f"{format_bytes(needed_bytes)}; free space there or choose another {flag}"
            )
