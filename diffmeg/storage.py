"""Disk-space facts shared by every writer (checkpoints, datasets, conversions).

Each writer turns a full disk or quota into one line naming the directory and its free space, and
removes what it left half-written; these helpers answer the questions that line needs.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


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
