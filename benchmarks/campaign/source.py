"""Where a run's code came from: the checkout's git revision, or the stamp written where the run was
prepared (a GPU machine of the device tool gets the working tree without `.git`).

    python3 -m benchmarks.campaign --prepare --wheels .whl    # in the checkout, before each GPU command

writes `.whl/campaign-source.json` (the carried wheels folder): the revision, whether tracked files were
modified, the list of tracked files and a digest of their contents. Where `git` cannot name the revision,
the campaign reads the stamp and recomputes the digest over the same files: equal means the tree is the
one prepared (`git_source` "stamp"); different means it changed after --prepare ("stamp (tree differs)",
reported dirty).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import subprocess
from pathlib import Path

STAMP_NAME = "campaign-source.json"


def _git(root: Path, *args: str) -> str:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _own_git(root: Path) -> bool:
    """Whether `root` is the top of a git checkout (not a folder inside some other repository)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    return bool(top) and Path(top).resolve() == root.resolve()


def tree_digest(root: Path, paths: list[str]) -> str:
    """sha256 over each path and the sha256 of its contents ("missing" where it cannot be read)."""
    h = hashlib.sha256()
    for rel in sorted(paths):
        h.update(rel.encode() + b"\0")
        try:
            h.update(hashlib.sha256((root / rel).read_bytes()).digest())
        except OSError:
            h.update(b"missing")
    return h.hexdigest()


def write_stamp(folder: Path, root: Path) -> dict:
    """Stamp the checkout at `root` into `folder`; {} where `root` is no git checkout."""
    if not _own_git(root):
        return {}
    files = [f for f in _git(root, "ls-files", "-z").split("\0") if f]
    stamp = {
        "git_revision": _git(root, "rev-parse", "HEAD"),
        "git_dirty": bool(_git(root, "status", "--porcelain", "--untracked-files=no")),
        "prepared": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "files": files,
        "digest": tree_digest(root, files),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STAMP_NAME).write_text(json.dumps(stamp) + "\n")
    return stamp


def source_revision(root: Path, stamp_folder: Path | None) -> tuple[str, bool | None, str]:
    """(git_revision, git_dirty, git_source) of the tree at `root`: from the stamp in `stamp_folder` where
    the tree's contents are the stamped ones, else from git where the checkout has it, else from a stamp
    whose tree differs, else ("unknown", None, "none").

    The stamp comes first: the device tool's copy may carry a `.git` of an older commit (the session's
    first) under a newer working tree, which git reports as that commit, dirty (seen on the first H100
    run, 2026-11-24); the stamp names the commit the tree actually is."""
    path = stamp_folder / STAMP_NAME if stamp_folder is not None else None
    present = path is not None and path.is_file()
    stamp = _read_stamp(path) if present else None
    if stamp is not None and tree_digest(root, stamp["files"]) == stamp["digest"]:
        return str(stamp["git_revision"]), bool(stamp["git_dirty"]), "stamp"
    if _own_git(root):
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
        return _git(root, "rev-parse", "HEAD") or "unknown", dirty, "git"
    if not present:
        return "unknown", None, "none"
    if stamp is None:
        return "unknown", None, f"none ({STAMP_NAME} unreadable)"
    return str(stamp["git_revision"]), True, "stamp (tree differs)"


def _read_stamp(path: Path) -> dict | None:
    """The stamp's fields, or None where it cannot be read."""
    try:
        stamp = json.loads(path.read_text())
        str(stamp["git_revision"]), bool(stamp["git_dirty"]), list(stamp["files"]), str(stamp["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return stamp
