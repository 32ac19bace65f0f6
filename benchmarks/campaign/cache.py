"""The Triton kernel cache, carried from one campaign command to the next (each starts a bare machine).

Compiling the ~70 kernels of the GPU tests and the tile candidates from a cold cache costs minutes of the
first command; later commands (and re-runs of a failed phase) find them compiled. Triton's cache records
absolute paths, so it lives at one fixed place on every machine (`cache_dir`: TRITON_CACHE_DIR where set,
else <tmp>/diffmeg-triton-cache). `save` writes it after the phases as one archive beside the results
(ARCHIVE_NAME in --out: one file, under the device tool's 16 MiB per file, the newest kernels kept when
everything does not fit); the next command restores it from `--triton-cache FILE`, by default
ARCHIVE_NAME in the --wheels folder that travels with each command (docs/gpu.md).
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from pathlib import Path

ARCHIVE_NAME = "triton-cache.tar.gz"
MAX_ARCHIVE_BYTES = 15 * 2**20  # the device tool returns files of at most 16 MiB


def cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path(tempfile.gettempdir()) / "diffmeg-triton-cache")


def restore(archive: Path, cache: Path) -> dict:
    """Unpack `archive` into `cache` (only plain files and folders inside it: tarfile's "data" filter)."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            names = tar.getnames()
            tar.extractall(cache, filter="data")
    except (OSError, tarfile.TarError) as exc:
        return {"restored_from": str(archive), "entries": 0, "error": f"{type(exc).__name__}: {exc}"[:300]}
    entries = {n.split("/", 1)[0] for n in names if n and n != "."}
    return {"restored_from": str(archive), "entries": len(entries), "error": None}


def _newest_first(cache: Path) -> list[Path]:
    """The cache's entries (one folder per compiled kernel), most recently written first."""

    def written(entry: Path) -> float:
        times = [f.stat().st_mtime for f in entry.rglob("*") if f.is_file()]
        return max(times, default=entry.stat().st_mtime)

    return sorted((e for e in cache.iterdir() if e.is_dir()), key=written, reverse=True)


def save(cache: Path, out: Path, limit: int = MAX_ARCHIVE_BYTES) -> dict | None:
    """Archive `cache` as out/ARCHIVE_NAME within `limit` bytes (dropping the oldest entries where all do
    not fit); None where there is nothing to save."""
    entries = _newest_first(cache) if cache.is_dir() else []
    if not entries:
        return None
    archive = out / ARCHIVE_NAME
    keep = len(entries)
    while True:
        with tarfile.open(archive, "w:gz") as tar:
            for entry in entries[:keep]:
                tar.add(entry, arcname=entry.name)
        size = archive.stat().st_size
        if size <= limit or keep <= 1:
            break
        keep = max(1, int(keep * min(0.9, limit / size)))
    if size > limit:
        archive.unlink()
        return {"saved": None, "entries": 0, "dropped": len(entries), "bytes": 0}
    return {"saved": str(archive), "entries": keep, "dropped": len(entries) - keep, "bytes": size}
