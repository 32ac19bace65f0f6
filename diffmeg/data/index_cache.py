"""Where megatron-core keeps a run's dataset indices (``--data-cache-path``), decided before it writes any.

megatron-core writes each GPTDataset's document, sample and shuffle indices, and a blend's dataset indices,
as files named by an md5 of what determines them (the dataset's path, split, seed, sequence length, sample
count). Left to itself it writes beside each dataset, failing after 45 lines of traceback when that folder
is read-only (the usual cluster case: datasets on shared read-only storage), and it caches no blend (a
warning on every blended run). So a run always gives it one folder, `resolve_cache_path`:

- ``--data-cache-path DIR``: DIR, which must be writable (else one line naming it and the fix);
- else ``cache/`` in the folder of the first dataset, when it can be written there;
- else the per-user cache ``$DIFFMEG_CACHE_DIR/datasets/<folder>-<hash of its path>`` (by default under
  ``~/.cache/diffmeg``), said in one line.

The builder hands megatron-core every dataset by absolute path (`megatron_prefixes`), so no two datasets
share an md5 name and one folder holds the indices of many datasets and runs without a collision. Rank 0
decides and every rank uses its answer: megatron-core builds the indices on rank 0 and the other ranks
read them, so a multi-node run whose nodes share no home folder passes --data-cache-path on storage every
node sees (a rank that cannot read what rank 0 wrote says so, `unreadable_cache`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from diffmeg.errors import DiffmegError
from diffmeg.storage import check_output, default_cache_dir, format_bytes, free_bytes

FLAG = "--data-cache-path"
USER_CACHE_SUBDIR = "datasets"
"""The per-user index caches live in `default_cache_dir()/datasets/`, one folder per dataset folder."""


def megatron_prefixes(prefixes: Sequence[str]) -> list[str]:
    """The prefixes as megatron-core gets them: absolute, so the md5 naming a dataset's index files names
    one dataset whatever the working directory was (two runs' relative `data/corpus` are not the same)."""
    return [os.path.abspath(p) for p in prefixes]


def beside_data(prefix: str) -> str:
    """The default cache when the dataset's own folder can be written: ``cache/`` in it."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")


def user_cache(prefix: str) -> str:
    """The per-user cache for the datasets of `prefix`'s folder, named after the folder and a hash of its
    real path, so two folders of the same name never share one and a look in the cache says whose it is."""
    folder = os.path.dirname(os.path.realpath(prefix))
    key = hashlib.sha256(folder.encode()).hexdigest()[:16]
    return os.path.join(default_cache_dir(), USER_CACHE_SUBDIR, f"{os.path.basename(folder) or 'root'}-{key}")


def writable(folder: str) -> bool:
    """Whether `folder` can be made (what is missing of it) and written here, by `check_output`'s rules."""
    try:
        check_output(folder, FLAG, folder=True)
    except DiffmegError:
        return False
    return True


def resolve_cache_path(prefixes: Sequence[str], given: str | None) -> tuple[str, str | None]:
    """(the folder megatron-core caches the indices of `prefixes` in, a line to tell the user or None).

    `given` is ``--data-cache-path``. Creates nothing; raises one line when no folder can be written.
    """
    if given:
        check_output(given, FLAG, folder=True)  # one line naming it and what is wrong, e.g. read-only
        return os.path.abspath(given), None
    first = prefixes[0]
    here = beside_data(first)
    if writable(here):
        return here, None
    fallback = user_cache(first)
    if not writable(fallback):
        raise DiffmegError(
            f"the dataset index cache can be written neither beside the data ({here}) nor in the per-user "
            f"cache ({fallback}); pass {FLAG} DIR, a folder you can write (on storage every node sees)"
        )
    return fallback, (
        f"data: {os.path.dirname(here)} cannot be written, so the dataset index cache is {fallback} "
        f"({FLAG} DIR chooses another; a multi-node run without a shared home needs one every node sees)"
    )


def unreadable_cache(cache: str, rank: int, missing: str) -> DiffmegError:
    """The line for a rank that cannot find the index files rank 0 wrote: the folder is not shared."""
    return DiffmegError(
        f"rank {rank} cannot read {missing}, which rank 0 wrote to the dataset index cache {cache}: that "
        f"folder is not shared between the nodes; pass {FLAG} DIR on storage every node sees"
    )


def in_folder(path: str, folder: str) -> bool:
    """Whether `path` lies under `folder` (both absolute)."""
    return os.path.commonpath([os.path.abspath(path), folder]) == folder


def unwritable_cache(cache: str, error: OSError) -> DiffmegError:
    """The line for index files that could not be written after the folder passed its checks (full, quota)."""
    where = f" ({format_bytes(free_bytes(cache))} free)" if free_bytes(cache) >= 0 else ""
    reason = error.strerror or str(error)
    return DiffmegError(
        f"cannot write the dataset index cache {cache}{where}: {reason}; free space there or pass {FLAG} DIR"
    )
