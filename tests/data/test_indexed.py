from __future__ import annotations

import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from diffmeg.data.indexed import (
    IndexedWriter,
    check_can_write,
    exists,
    merge_datasets,
    order_shards,
    resolve_prefixes,
)
from diffmeg.errors import DiffmegError
from tests.data.helpers import leftovers, read_documents, write_dataset


def test_writer_commits_a_readable_int32_dataset(tmp_path):
    docs = [[1, 2, 3], [], [100257], list(range(1000))]
    prefix = write_dataset(tmp_path / "d", docs)
    ds = IndexedDataset(prefix)
    assert ds.index.dtype == np.int32 and len(ds) == 4
    assert [d.tolist() for d in read_documents(prefix)] == docs
    assert leftovers(tmp_path) == ["d.bin", "d.idx"]


def test_writer_leaves_nothing_when_not_committed(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedWriter(str(tmp_path / "d")) as w:
            w.add_document(np.arange(10, dtype=np.int32))
            assert leftovers(tmp_path) == [f"d.bin.tmp-{os.getpid()}"]
            raise RuntimeError("interrupted")
    assert leftovers(tmp_path) == []


def test_commit_replaces_an_existing_dataset(tmp_path):
    write_dataset(tmp_path / "d", [[1, 2]])
    write_dataset(tmp_path / "d", [[3], [4, 5]])
    assert [d.tolist() for d in read_documents(str(tmp_path / "d"))] == [[3], [4, 5]]


def test_check_can_write(tmp_path):
    write_dataset(tmp_path / "d", [[1]])
    with pytest.raises(DiffmegError, match="already exists; pass --overwrite"):
        check_can_write([str(tmp_path / "d")], overwrite=False)
    check_can_write([str(tmp_path / "d")], overwrite=True)
    check_can_write([str(tmp_path / "no" / "such" / "d")], overwrite=False)  # issue 31: the folder is made
    assert (tmp_path / "no" / "such").is_dir()
    with pytest.raises(DiffmegError, match=r"--output-prefix .*/d\.bin/x\.bin: .*/d\.bin is a file, so"):
        check_can_write([str(tmp_path / "d.bin" / "x")], overwrite=False)


def test_merge_concatenates_in_order(tmp_path):
    a = write_dataset(tmp_path / "a", [[1, 2], [3]])
    b = write_dataset(tmp_path / "b", [[], [4, 5, 6]])
    writer = merge_datasets([b, a], str(tmp_path / "m"))
    assert (writer.documents, writer.tokens) == (4, 6)
    assert [d.tolist() for d in read_documents(str(tmp_path / "m"))] == [[], [4, 5, 6], [1, 2], [3]]
    with pytest.raises(DiffmegError, match="already exists"):
        merge_datasets([a], str(tmp_path / "m"))
    with pytest.raises(DiffmegError, match="also an input"):
        merge_datasets([a], a, overwrite=True)


def test_merge_refuses_mixed_token_types(tmp_path):
    a = write_dataset(tmp_path / "a", [[1]])
    b = write_dataset(tmp_path / "b", [[2]], dtype=np.uint16)
    with pytest.raises(DiffmegError, match="uint16"):
        merge_datasets([a, b], str(tmp_path / "m"))
    assert not exists(str(tmp_path / "m"))
    assert leftovers(tmp_path) == ["a.bin", "a.idx", "b.bin", "b.idx"]


def test_resolve_prefixes(tmp_path):
    for name in ("x2", "x1", "y"):
        write_dataset(tmp_path / name, [[1]])
    (tmp_path / "x3.bin").write_bytes(b"")  # no .idx: not a dataset
    p = str(tmp_path)
    assert resolve_prefixes([f"{p}/x*"]) == [f"{p}/x1", f"{p}/x2"]
    assert resolve_prefixes([p]) == [f"{p}/x1", f"{p}/x2", f"{p}/y"]
    assert resolve_prefixes([f"{p}/y.idx", f"{p}/x2"]) == [f"{p}/y", f"{p}/x2"]
    with pytest.raises(DiffmegError, match="x3.idx"):
        resolve_prefixes([f"{p}/x3"])
    with pytest.raises(DiffmegError, match="no dataset"):
        resolve_prefixes([f"{p}/z*"])


def test_order_shards():
    shards = [f"/d/out-rank{r:05d}-of-00003_text_document" for r in (2, 0, 1)]
    assert order_shards(shards) == sorted(shards)
    with pytest.raises(DiffmegError, match=r"missing rank\(s\) \[1\] of 3"):
        order_shards([shards[0], shards[1]])
    assert order_shards(["/d/b", "/d/a"]) == ["/d/b", "/d/a"]  # not shards: order kept


def test_add_documents_writes_the_same_files_as_add_document(tmp_path):
    docs = [[1, 2, 3], [], [7] * 100, [100257]]
    write_dataset(tmp_path / "one", docs)
    with IndexedWriter(str(tmp_path / "many")) as w:
        w.add_documents(np.array([], dtype=np.int32), np.array([], dtype=np.int64))
        w.add_documents(np.array(docs[0] + docs[1], dtype=np.int32), np.array([3, 0]))
        w.add_documents(np.array(docs[2] + docs[3], dtype=np.int32), np.array([100, 1]))
        assert (w.documents, w.tokens) == (4, 104)
        w.commit()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"many{ext}").read_bytes()


def test_check_dataset_counts_tokens_of_a_consistent_pair(tmp_path):
    from diffmeg.data.indexed import check_dataset

    assert check_dataset(write_dataset(tmp_path / "d", [[1, 2, 3], [], list(range(50))])) == 53
    assert check_dataset(write_dataset(tmp_path / "u", [[7] * 9], dtype=np.uint16)) == 9
    assert check_dataset(write_dataset(tmp_path / "empty", [])) == 0


def test_a_truncated_bin_or_a_garbage_idx_is_named_in_one_line(tmp_path):
    """An interrupted copy (the .bin cut short, its .idx whole) or a damaged .idx: the file, the sizes and
    what to do, before megatron-core reads past the end."""
    from diffmeg.data.indexed import check_dataset

    prefix = write_dataset(tmp_path / "d", [list(range(100)), list(range(20))])
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(300)
    with pytest.raises(DiffmegError) as info:
        check_dataset(prefix)
    assert str(info.value) == (
        f"{prefix}.bin is 300 bytes but its index d.idx expects 480 (2 sequences of 2 documents): truncated "
        "(an interrupted copy?); copy it again or write the dataset again with tools/preprocess_data.py"
    )
    (tmp_path / "g.bin").write_bytes(b"\0" * 64)
    (tmp_path / "g.idx").write_bytes(b"this is not an index at all, just some bytes")
    with pytest.raises(DiffmegError, match=r"g\.idx is not a megatron-core dataset index \(no MMIDIDX"):
        check_dataset(str(tmp_path / "g"))
    whole = write_dataset(tmp_path / "w", [list(range(10))])
    idx = (tmp_path / "w.idx").read_bytes()
    (tmp_path / "w.idx").write_bytes(idx[:-5])
    with pytest.raises(DiffmegError, match=r"w\.idx is \d+ bytes but its header \(1 sequences, 2 document"):
        check_dataset(whole)
