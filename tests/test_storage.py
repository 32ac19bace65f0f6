"""diffmeg/storage.py: the disk facts behind every writer's one-line full-disk error; the atomic writer."""

from __future__ import annotations

import errno
import os
import re
import shutil

import pytest

from diffmeg.storage import atomic_write, directory_bytes, format_bytes, free_bytes, is_disk_full, write_json


def test_free_bytes_asks_the_nearest_existing_parent(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    free = shutil.disk_usage(tmp_path).free
    for path in ("not/yet/made", str(tmp_path / "missing" / "deeper"), "."):
        assert abs(free_bytes(path) - free) < 64 * 2**20  # the same file system, give or take other writers


def test_directory_bytes_counts_every_file_below(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 23)
    assert directory_bytes(str(tmp_path)) == 123
    assert directory_bytes(str(tmp_path / "absent")) == 0


class _PerRankFailures(Exception):
    """Like torch.distributed.checkpoint's CheckpointException: failures per rank, some as tuples."""

    def __init__(self, failures: dict) -> None:
        super().__init__("checkpoint failed")
        self.failures = failures


def test_is_disk_full_looks_through_causes_and_per_rank_failures():
    full = OSError(errno.ENOSPC, "No space left on device")
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert is_disk_full(full) and is_disk_full(quota)
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("save failed") from exc
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert is_disk_full(_PerRankFailures({0: ValueError("ok"), 1: (quota, "traceback")}))
    assert is_disk_full(RuntimeError("write: No space left on device"))  # torch's zip writer, no errno
    assert not is_disk_full(_PerRankFailures({0: OSError(errno.EACCES, "Permission denied")}))
    assert not is_disk_full(None)


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 2048, 3 * 2**20 + 2**19, 5 * 2**30)] == [
        "512 B",
        "2.0 KiB",
        "3.5 MiB",
        "5.0 GiB",
    ]


def test_check_output_names_each_unwritable_output_as_what_it_is(tmp_path, monkeypatch):
    """The one check every tool runs on its outputs before work starts: a file in the way, a folder where a
    file goes, no permission, too little room, a read-only file system; creates nothing."""
    from diffmeg.errors import DiffmegError
    from diffmeg.storage import check_output

    (tmp_path / "file").write_text("x")
    check_output(str(tmp_path / "new" / "deeper"), "--save", folder=True)
    check_output(str(tmp_path / "new" / "metrics.jsonl"), "--metrics-file", folder=False)
    assert sorted(os.listdir(tmp_path)) == ["file"]
    cases = [
        (tmp_path / "file", True, "--save", f"--save {tmp_path}/file is a file, not a folder"),
        (tmp_path, False, "--metrics-file", f"--metrics-file {tmp_path} is a folder, not a file"),
        (tmp_path / "file" / "run", True, "--tensorboard-dir", f"{tmp_path}/file is a file, so the folder"),
        ("/proc/sys/diffmeg-test", True, "--save", "no permission to write in /proc/sys"),
    ]
    for path, folder, flag, message in cases:
        with pytest.raises(DiffmegError, match=re.escape(message)) as err:
            check_output(str(path), flag, folder=folder)
        assert "\n" not in str(err.value)
    with pytest.raises(DiffmegError, match=r"/out: .* free but this writes about 909494.7 TiB; free"):
        check_output(str(tmp_path / "out"), "--save", folder=True, needed_bytes=10**18)

    real = os.statvfs

    class ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: ReadOnly() if str(p).startswith(str(tmp_path)) else real(p))
    with pytest.raises(DiffmegError) as err:
        check_output(str(tmp_path / "out"), "--output-prefix", folder=False)
    assert str(err.value) == (
        f"--output-prefix {tmp_path}/out is on a read-only file system ({tmp_path}); choose another "
        "--output-prefix"
    )


def test_atomic_write_replaces_whole_or_leaves_the_previous_file(tmp_path):
    target = tmp_path / "out.json"
    write_json(str(target), {"a": 1})
    assert target.read_text() == '{\n  "a": 1\n}\n'
    with pytest.raises(RuntimeError, match="^stop$"):
        with atomic_write(str(target)) as f:
            f.write("half")
            raise RuntimeError("stop")
    assert target.read_text() == '{\n  "a": 1\n}\n'  # the previous file, whole
    assert os.listdir(tmp_path) == ["out.json"]  # and no temporary
