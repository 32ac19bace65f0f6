"""One owner per run folder: the lock a run takes on its output folder before it writes anything there.

Two runs on one --save folder (a requeued Slurm job overlapping its predecessor, a script started twice)
would write into each other's checkpoints. `FolderLock` refuses the second in one line naming the owner
(host, pid, Slurm job, start time, command) and the fix. The lock is a POSIX record lock (fcntl) on
`{folder}/run.lock`, the kind NFS, IBM Storage Scale and Lustre mounted with `-o flock` keep across nodes
(docs/recipes.md, "One run per folder"); the operating system drops it with its process. A run killed
with SIGKILL, or whose node went down, leaves the file with its owner record but without a lock: the next
run takes it over and says whose it was. A run that ends (or stops on an error) clears and removes the
file, and the folders it made for it while they are still empty, so a run refused before training leaves
nothing behind.

A file system that refuses locks (ENOLCK, EOPNOTSUPP, ENOSYS: NFS without a lock service, Lustre mounted
`-o noflock`) is said in one line and the run goes on without one: refusing would stop every run on such
a mount, and each save removes only what it wrote (`diffmeg.checkpoints`) whoever else writes there.

POSIX locks belong to a process: closing any descriptor of the file drops them, and a process locking a
file it holds already succeeds. So a process opens the file once (`_HELD`), and a second `FolderLock` of
the same folder in one process (tests build several Trainers) takes the lock over from the first.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass, field

from diffmeg.errors import DiffmegError

LOCK_FILE = "run.lock"
UNSUPPORTED_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})
"""A file system that does not lock: said in one line, the run goes on unlocked."""
HELD_ERRNOS = frozenset({errno.EACCES, errno.EAGAIN})
"""Another process holds the lock."""


@dataclass(frozen=True)
class Owner:
    """Who holds a folder: the record a lock file carries while its run lives."""

    host: str
    pid: int
    started: str
    """UTC, to the second."""
    command: str
    slurm_job: str | None = None
    """SLURM_JOB_ID when the run is a Slurm job (a requeued job keeps its id)."""

    @classmethod
    def of_this_process(cls) -> Owner:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            command=shlex.join([os.path.basename(sys.executable), *sys.argv]),
            slurm_job=os.environ.get("SLURM_JOB_ID") or None,
        )

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):
            return None  # empty (released, or being written) or not ours

    def describe(self) -> str:
        job = f" (Slurm job {self.slurm_job})" if self.slurm_job else ""
        command = self.command if len(self.command) <= 200 else self.command[:197] + "..."
        return f"pid {self.pid} on {self.host}{job}, started {self.started}: {command}"

    def how_to_stop(self) -> str:
        """`scancel JOB`, unless that job is this one (a requeued job overlapping its own earlier start)."""
        if self.slurm_job and self.slurm_job != os.environ.get("SLURM_JOB_ID"):
            return f"scancel {self.slurm_job}"
        return f"kill {self.pid} on {self.host}"


@dataclass
class _Handle:
    """A folder this process holds: the lock file's descriptor (None: its file system does not lock)."""

    fd: int | None
    path: str
    created: list[str] = field(default_factory=list)
    """The folders made for the lock, deepest first: removed at release while they are still empty."""
    holder: object = None
    """The `FolderLock` holding it now."""


_HELD: dict[str, _Handle] = {}
"""This process's folders (by real path): at most one descriptor per lock file."""


class FolderLock:
    """The lock of one run folder, held by this process from `acquire` to `release` (or its exit)."""

    def __init__(self, folder: str, flag: str = "--save") -> None:
        self.folder = os.path.abspath(folder)
        self.flag = flag
        """The option that named the folder, for the messages."""
        self._handle: _Handle | None = None

    @property
    def held(self) -> bool:
        return self._handle is not None and self._handle.holder is self and self._handle.fd is not None

    def acquire(self) -> str | None:
        """Make the folder (if missing) and take its lock; returns a line to print when the lock was left
        by a run that died, or when the file system does not lock, else None. Another live run holding
        it, or a folder that cannot be made or written, is one `DiffmegError` line."""
        created = _make_folder(self.folder, self.flag)
        key = os.path.realpath(self.folder)
        if key in _HELD:  # this process holds it already: the new holder takes it over
            self._handle = _HELD[key]
            self._handle.holder = self
            self._write_owner()
            return None
        path = os.path.join(self.folder, LOCK_FILE)
        for _ in range(10):
            try:
                fd, made = _open(path)
            except OSError as exc:
                if isinstance(exc, FileNotFoundError) and not os.path.isdir(self.folder):
                    # removed by a run that released it just now: make it again
                    created += _make_folder(self.folder, self.flag)
                    continue
                why = exc.strerror or exc
                raise DiffmegError(f"{self.flag} {self.folder} is not writable: {why}") from exc
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                owner = Owner.parse(_read(fd))
                os.close(fd)
                if exc.errno in HELD_ERRNOS:
                    raise DiffmegError(self._in_use(owner)) from exc
                if exc.errno not in UNSUPPORTED_ERRNOS:
                    why = f"{self.flag} {self.folder}: cannot lock {path}: {exc.strerror}"
                    raise DiffmegError(why) from exc
                if made:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                self._handle = _Handle(None, path, created, self)
                return (
                    f" {self.flag} {self.folder}: its file system does not lock files "
                    f"({errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}), so another run on this "
                    f"folder cannot be refused; make sure none uses it (docs/recipes.md: One run per folder)"
                )
            if not _same_file(fd, path):  # unlinked by the run that released it just now: lock the new one
                os.close(fd)
                continue
            left = Owner.parse(_read(fd))  # a record under a free lock: its run died without releasing it
            self._handle = _HELD[key] = _Handle(fd, path, created, self)
            self._write_owner()
            return None if left is None else self._taken_over(left)
        raise DiffmegError(f"{self.flag} {self.folder}: {path} kept being replaced while locked; try again")

    def release(self) -> None:
        """Clear and remove the lock file, then the folders made for it if still empty; drop the lock."""
        handle, self._handle = self._handle, None
        if handle is not None and handle.holder is self:
            _release(handle)

    def _write_owner(self) -> None:
        """This process's record into the lock file it holds (a full disk: released, one line)."""
        data = json.dumps(asdict(Owner.of_this_process())).encode()
        try:
            os.ftruncate(self._handle.fd, 0)
            os.pwrite(self._handle.fd, data, 0)
        except OSError as exc:
            self.release()
            raise DiffmegError(f"{self.flag} {self.folder} is not writable: {exc.strerror or exc}") from exc

    def _in_use(self, owner: Owner | None) -> str:
        if owner is None:
            return (
                f"{self.flag} {self.folder} is in use by another run (it is writing its owner record into "
                f"{LOCK_FILE} now); wait for it to end, stop it, or choose another {self.flag}"
            )
        return (
            f"{self.flag} {self.folder} is in use by another run: {owner.describe()}; wait for it to end, "
            f"stop it ({owner.how_to_stop()}), or choose another {self.flag}"
        )

    def _taken_over(self, owner: Owner) -> str:
        line = (
            f" {self.flag} {self.folder}: took over the lock of a run that ended without releasing it "
            f"(killed, or its node went down): {owner.describe()}"
        )
        if owner.host != socket.gethostname():
            line += (
                f" (if it still runs on {owner.host}, this file system's locks do not reach across nodes: "
                f"stop it; docs/recipes.md: One run per folder)"
            )
        return line


def _make_folder(folder: str, flag: str) -> list[str]:
    """Make `folder` and its missing parents; the ones made, deepest first."""
    missing = []
    path = folder
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise DiffmegError(f"{flag} {folder} cannot be created: {exc.strerror or exc}") from exc
    return missing


def _open(path: str) -> tuple[int, bool]:
    """The lock file's descriptor (read-write: fcntl's write lock needs it) and whether it was made now."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
    except FileExistsError:
        return os.open(path, flags), False


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 65536, 0).decode(errors="replace")
    except OSError:
        return ""


def _same_file(fd: int, path: str) -> bool:
    """`fd` is the file at `path` now (not one unlinked since it was opened)."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _release(handle: _Handle) -> None:
    if handle.fd is not None:
        for key, held in list(_HELD.items()):
            if held is handle:
                del _HELD[key]
        try:
            os.ftruncate(handle.fd, 0)  # a run that dies before the unlink leaves an empty record: no owner
            if _same_file(handle.fd, handle.path):
                os.unlink(handle.path)  # while locked: no other run holds this file now
        except OSError:
            pass
        os.close(handle.fd)
        handle.fd = None
    handle.holder = None
    for folder in handle.created:
        try:
            os.rmdir(folder)  # only while empty: what the run wrote keeps its folder
        except OSError:
            break


@atexit.register
def _release_all() -> None:
    """A process that exits (an error after the lock was taken included) releases what it holds."""
    for handle in list(_HELD.values()):
        _release(handle)
