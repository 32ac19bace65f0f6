"""diffmeg.folder_lock with plain processes: a second owner refused in one line, a dead owner's lock taken
over, a file system without locks said and gone on with, and nothing left behind by a run that ends."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from diffmeg import folder_lock
from diffmeg.errors import DiffmegError
from diffmeg.folder_lock import LOCK_FILE, FolderLock
from tests.conftest import REPO_ROOT


def test_a_second_owner_is_refused_in_one_line_naming_the_first(tmp_path, folder_holder, monkeypatch):
    folder = tmp_path / "run"
    first = folder_holder(folder, SLURM_JOB_ID="5678")
    record = (folder / LOCK_FILE).read_text()
    owner = json.loads(record)
    assert (owner["pid"], owner["host"], owner["slurm_job"]) == (first.pid, socket.gethostname(), "5678")
    with pytest.raises(DiffmegError) as err:
        FolderLock(str(folder)).acquire()
    assert str(err.value) == (
        f"--save {folder} is in use by another run: pid {first.pid} on {socket.gethostname()} (Slurm job "
        f"5678), started {owner['started']}: {owner['command']}; wait for it to end, stop it (scancel 5678), "
        f"or choose another --save"
    )
    assert (folder / LOCK_FILE).read_text() == record  # the refused one changed nothing
    monkeypatch.setenv("SLURM_JOB_ID", "5678")  # the same job requeued while its earlier start still runs
    with pytest.raises(DiffmegError, match=rf"stop it \(kill {first.pid} on {socket.gethostname()}\)"):
        FolderLock(str(folder)).acquire()
    first.stdin.close()
    assert first.wait(timeout=60) == 0
    assert not folder.exists()  # made for the lock, still empty: gone with it


def test_a_lock_left_by_a_killed_run_is_taken_over_with_one_line(tmp_path, folder_holder):
    """SIGKILL (or a node that went down) leaves the record but not the lock: the next run starts."""
    first = folder_holder(tmp_path)
    (tmp_path / "iter_0000002").mkdir()  # what the dead run wrote stays
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    owner = json.loads((tmp_path / LOCK_FILE).read_text())
    lock = FolderLock(str(tmp_path))
    assert lock.acquire() == (
        f" --save {tmp_path}: took over the lock of a run that ended without releasing it (killed, or its "
        f"node went down): pid {first.pid} on {socket.gethostname()}, started {owner['started']}: "
        f"{owner['command']}"
    )
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert os.listdir(tmp_path) == ["iter_0000002"]  # an existing folder and what is in it stay


def test_a_lock_held_without_a_record_yet_is_refused_too(tmp_path):
    """The owner writes its record just after locking: a run arriving in between is still refused."""
    script = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.lockf(fd, fcntl.LOCK_EX); print(flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / LOCK_FILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    proc.stdout.readline()
    with pytest.raises(DiffmegError, match=r"is in use by another run \(it is writing its owner record"):
        FolderLock(str(tmp_path), "--output").acquire()
    proc.stdin.close()
    proc.wait(timeout=60)


def test_a_file_system_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    lock = FolderLock(str(tmp_path / "run"))
    assert lock.acquire() == (
        f" --save {tmp_path / 'run'}: its file system does not lock files (ENOLCK: No locks available), so "
        f"another run on this folder cannot be refused; make sure none uses it (docs/recipes.md: One run per "
        f"folder)"
    )
    assert os.listdir(tmp_path / "run") == [] and not lock.held  # no lock file left behind
    lock.release()
    assert not (tmp_path / "run").exists()


def test_a_full_disk_at_the_owner_record_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(DiffmegError, match=r"^--save .*/run is not writable: No space left on device$"):
        FolderLock(str(tmp_path / "run")).acquire()
    assert os.listdir(tmp_path) == [] and os.path.realpath(tmp_path / "run") not in folder_lock._HELD


def test_one_process_holds_a_folder_once(tmp_path):
    """POSIX locks are the process's: a second FolderLock of the folder in the same process (tests build
    several Trainers) takes it over; the first's release then leaves it held."""
    first, second = FolderLock(str(tmp_path)), FolderLock(str(tmp_path))
    assert first.acquire() is None and second.acquire() is None
    assert second.held and not first.held
    first.release()
    assert (tmp_path / LOCK_FILE).exists()
    with pytest.raises(DiffmegError, match="is in use by another run"):
        _probe_from_another_process(tmp_path)
    second.release()
    assert os.listdir(tmp_path) == [] and os.path.realpath(tmp_path) not in folder_lock._HELD
    _probe_from_another_process(tmp_path)


def _probe_from_another_process(folder) -> None:
    script = (
        "import sys; from diffmeg.folder_lock import FolderLock; l = FolderLock(sys.argv[1]); l.acquire()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    if proc.returncode != 0:
        raise DiffmegError(proc.stderr.strip().splitlines()[-1])
