"""The folder a conversion writes (`--save`): which of its entries the conversion owns, and writing it so
that nothing is lost when a conversion fails.

`--overwrite` replaces only what a conversion writes (`OutputFiles`), never anything else:
- a Hugging Face export (mcore-to-hf, `HF_EXPORT`): config.json, the weights (model.safetensors or its
  shards) with their index, generation_config.json, the tokenizer's files and the remote-code file. Every
  other entry stays: a model card, a Hub clone's .git, the user's own files and folders;
- a checkpoint (hf-to-mcore, upcycle, `CONVERTED_CHECKPOINT`): iter_0000000/, the tracker and tokenizer/.
  A folder holding anything else (another run's iterations and arguments, the user's files) is refused in
  one line: its tracker decides what a later `--load` reads, so it cannot be shared.

The new output is built in a temporary folder (beside a new output; inside an existing one, so that every
move stays on its file system) and moved into place only when complete: a failure, a full disk or Ctrl-C
removes the temporary folder and leaves the previous output as it was. Only then are the previous output's
own entries moved aside, the new ones moved in, and the old ones deleted. An existing output is locked
meanwhile (`diffmeg.folder_lock`, its `run.lock` neither the conversion's nor another's entry): a run
training into it makes the conversion one line naming that run. A full disk is named as such, and the
output follows the umask like any folder the user creates.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from diffmeg.checkpoints import TOKENIZER_DIR, TRACKER_FILE, checkpoint_path
from diffmeg.conversion.hf_config import MOTIF_REMOTE_CODE_FILES, REMOTE_CODE_FILE
from diffmeg.conversion.safetensors_io import INDEX_FILE
from diffmeg.data.hf_tokenizer import TOKENIZER_FILES
from diffmeg.data.indexed import pid_alive
from diffmeg.errors import DiffmegError
from diffmeg.folder_lock import LOCK_FILE, FolderLock
from diffmeg.storage import check_output, is_disk_full, paths_overlap

_TEMPORARY = re.compile(r"\.convert-(?:new|old)-(\d+)-")
"""The temporary folders a conversion makes inside an existing output: `.convert-new-<pid>-...`."""


@dataclass(frozen=True)
class OutputFiles:
    """The entries of an output folder that one kind of conversion writes."""

    what: str
    """What the conversion writes, for messages ("a Hugging Face export")."""
    names: frozenset[str]
    """Entries it writes by name."""
    listed: str
    """Those entries, for messages."""
    keep_others: bool
    """True: other entries stay in the folder; False: a folder holding other entries is refused."""
    pattern: str | None = None
    """Entries it writes by pattern (numbered shards)."""

    def owns(self, name: str) -> bool:
        """Whether the entry `name` is one this conversion writes (or a temporary a killed one left)."""
        if name in self.names or (self.pattern and re.fullmatch(self.pattern, name)):
            return True
        match = _TEMPORARY.match(name)
        return match is not None and not pid_alive(int(match.group(1)))


HF_EXPORT = OutputFiles(
    what="a Hugging Face export",
    names=frozenset(
        {"config.json", "generation_config.json", "model.safetensors", INDEX_FILE, REMOTE_CODE_FILE}
        | set(MOTIF_REMOTE_CODE_FILES)
        | set(TOKENIZER_FILES)
    ),
    listed=f"config.json, the safetensors weights and {INDEX_FILE}, generation_config.json, the tokenizer's "
    f"files, the remote code ({', '.join((REMOTE_CODE_FILE, *MOTIF_REMOTE_CODE_FILES))})",
    keep_others=True,
    pattern=r"model-\d{5}-of-\d{5}\.safetensors",
)
CONVERTED_CHECKPOINT = OutputFiles(
    what="a converted checkpoint",
    names=frozenset({os.path.basename(checkpoint_path("", 0)), TRACKER_FILE, TOKENIZER_DIR}),
    listed=f"{os.path.basename(checkpoint_path('', 0))}/, {TRACKER_FILE}, {TOKENIZER_DIR}/",
    keep_others=False,
)


def some_names(names: list[str]) -> str:
    """The first two names and how many more (for a one-line message)."""
    shown = ", ".join(names[:2])
    return shown + (f" and {len(names) - 2} more" if len(names) > 2 else "")


def check_output_path(output: str, overwrite: bool, source: str, files: OutputFiles) -> list[str]:
    """Refuse an output overlapping the source, an existing non-empty output without --overwrite, and (for
    `files` that keep nothing else) an output holding entries the conversion does not write. Returns the
    entries of an existing output that the conversion will leave in place."""
    if paths_overlap(output, source):
        raise DiffmegError(f"--save {output} overlaps --load {source}; write the conversion elsewhere")
    others: list[str] = []
    if os.path.lexists(output):
        if not os.path.isdir(output):
            raise DiffmegError(f"{output} exists and is not a directory; remove it first")
        entries = sorted(os.listdir(output))
        for name in entries:
            match = _TEMPORARY.match(name)
            if match and pid_alive(int(match.group(1))):
                raise DiffmegError(
                    f"process {match.group(1)} is writing {output} now ({name}); wait for it or choose "
                    f"another --save"
                )
        others = [name for name in entries if name != LOCK_FILE and not files.owns(name)]
        if [name for name in entries if name != LOCK_FILE] and not overwrite:
            keeps = "; its other files stay" if files.keep_others else ""
            raise DiffmegError(
                f"{output} already exists; pass --overwrite to replace the files of {files.what} in it "
                f"({files.listed}{keeps})"
            )
        if others and not files.keep_others:
            raise DiffmegError(
                f"--save {output} holds {some_names(others)}, which a conversion does not write; --overwrite "
                f"replaces only {files.what} ({files.listed}): choose a new or empty --save folder, or "
                f"move those out of it"
            )
    check_output(output, "--save", folder=True)  # read-only, no permission, a file in the way
    return others


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**9 else f"{n / 1e6:.1f} MB"


def _disk_full(exc: BaseException, free: int) -> bool:
    """The failure is (or was caused by) a full disk or quota.

    DCP wraps its writers' errors (CheckpointException.failures) and torch.save reports a failed write
    as "unexpected pos"; so besides ENOSPC / EDQUOT anywhere in the chain, a write failure with less
    than 16 MB left on the filesystem counts as a full disk.
    """
    if is_disk_full(exc):
        return True
    interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))
    return not interrupted and free < 16 * 2**20


def _move(names: Iterable[str], source: str, destination: str) -> list[str]:
    """Move entries between two folders of one file system; the names moved."""
    moved = []
    for name in names:
        os.replace(os.path.join(source, name), os.path.join(destination, name))
        moved.append(name)
    return moved


def _swap_in(output: str, new: str, files: OutputFiles) -> None:
    """Replace the entries of `output` that `files` owns with those of the finished folder `new` (inside
    it); on a failure the previous entries go back."""
    old = tempfile.mkdtemp(prefix=f".convert-old-{os.getpid()}-", dir=output)
    aside: list[str] = []
    placed: list[str] = []
    try:
        skip = {os.path.basename(new), os.path.basename(old), LOCK_FILE}  # the lock this conversion holds
        aside = _move([n for n in os.listdir(output) if n not in skip and files.owns(n)], output, old)
        placed = _move(os.listdir(new), new, output)
    except BaseException:
        _move(placed, output, new)
        _move(aside, old, output)
        shutil.rmtree(new, ignore_errors=True)
        os.rmdir(old)
        raise
    os.rmdir(new)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(output: str, files: OutputFiles, needed_bytes: int | None = None) -> Iterator[str]:
    """A fresh folder that becomes `output` (or, where `output` exists, replaces the entries of it that
    `files` owns) when the block succeeds; an existing `output` is locked meanwhile (a run holding it: one
    line naming the run, nothing touched).

    `needed_bytes` (what the conversion will write) is checked against the free space first. On any
    failure the temporary folder is removed and an existing `output` is left untouched; a full disk
    is reported in one line naming the folder and its free space. A new output gets the mode a plain
    `mkdir` would give it (the umask applies), like every file written into it.
    """
    parent = os.path.dirname(os.path.abspath(output)) or "."
    os.makedirs(parent, exist_ok=True)
    existing = os.path.isdir(output)
    where = output if existing else parent
    if needed_bytes is not None:
        free = shutil.disk_usage(where).free
        if free < needed_bytes:
            raise DiffmegError(
                f"{where} has {_gb(free)} free but the conversion writes about {_gb(needed_bytes)}; "
                f"free space there or choose another --save"
            )
    lock = FolderLock(output) if existing else None  # never replace a folder a run holds
    if lock is not None and (note := lock.acquire()) is not None:
        print(note, flush=True)
    if existing:
        tmp = tempfile.mkdtemp(prefix=f".convert-new-{os.getpid()}-", dir=output)
    else:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output))}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException as exc:
        if lock is not None:
            lock.release()
        free_at_failure = shutil.disk_usage(where).free
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, DiffmegError) and _disk_full(exc, free_at_failure):
            needed = f" (the conversion writes about {_gb(needed_bytes)})" if needed_bytes else ""
            free = _gb(shutil.disk_usage(where).free)
            raise DiffmegError(
                f"disk full writing {output}: partial output removed, {where} has {free} free{needed}; "
                f"free space there or choose another --save"
            ) from exc
        raise
    if existing:
        try:
            _swap_in(output, tmp, files)
        finally:
            lock.release()
    else:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private
        os.replace(tmp, output)
