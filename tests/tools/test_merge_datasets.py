from __future__ import annotations

import errno
import os
import stat
import subprocess

import numpy as np
import pytest

from diffmeg.data.indexed import IndexedWriter
from tests.data.helpers import read_documents
from tests.tools.helpers import run_tool


def make_shard(prefix, docs) -> None:
    with IndexedWriter(str(prefix)) as w:
        for doc in docs:
            w.add_document(np.asarray(doc, dtype=np.int32))
        w.commit()


def test_merges_rank_shards_in_rank_order_and_refuses_incomplete_sets(tmp_path):
    shard = lambda r: tmp_path / f"c-rank{r:05d}-of-00003_text_document"  # noqa: E731
    for rank in (2, 0):
        make_shard(shard(rank), [[rank, rank], [rank]])
    glob = tmp_path / "c-rank*-of-00003_text_document"
    proc = run_tool("merge_datasets", "--input", glob, "--output-prefix", tmp_path / "merged")
    assert proc.returncode == 2 and "missing rank(s) [1] of 3" in proc.stderr

    make_shard(shard(1), [[], [1, 1, 1]])
    # explicit shards out of order still merge in rank order
    proc = run_tool(
        "merge_datasets", "--input", shard(2), shard(0), shard(1), "--output-prefix", tmp_path / "merged"
    )
    assert proc.returncode == 0, proc.stderr
    assert "merged 3 datasets: 6 documents, 9 tokens" in proc.stderr
    docs = [d.tolist() for d in read_documents(str(tmp_path / "merged"))]
    assert docs == [[0, 0], [0], [], [1, 1, 1], [2, 2], [2]]


def test_merged_dataset_follows_the_umask_and_replaces_a_killed_runs_temporaries(tmp_path):
    make_shard(tmp_path / "a", [[1, 2], [3]])
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"merged.bin.tmp-{dead.pid}"  # what a SIGKILLed merge leaves
    stale.write_bytes(b"partial")
    old = os.umask(0o002)
    try:
        proc = run_tool("merge_datasets", "--input", tmp_path / "a", "--output-prefix", tmp_path / "merged")
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    assert f"removed 1 stale temporaries of process {dead.pid}, which no longer runs: {stale}" in proc.stderr
    assert not stale.exists()
    for suffix in (".bin", ".idx"):
        assert stat.S_IMODE((tmp_path / f"merged{suffix}").stat().st_mode) == 0o664


def test_full_disk_while_merging_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    from diffmeg.data import indexed

    make_shard(tmp_path / "a", [list(range(5000))])

    class FullDisk(indexed.IndexedDatasetBuilder):
        def add_index(self, path_prefix: str) -> None:
            self.data_file.write(b"\0" * 4096)  # part of the copy landed, then the disk filled
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(indexed, "IndexedDatasetBuilder", FullDisk)
    with pytest.raises(
        indexed.DiskFullError, match=rf"^disk full in {tmp_path}: .* free after 4.0 KiB of output"
    ):
        indexed.merge_datasets([str(tmp_path / "a")], str(tmp_path / "merged"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "a.ids.json", "a.idx"]  # the input only
