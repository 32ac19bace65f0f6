"""Loss-masked datasets (diffmeg/data/loss_mask.py): the companion mask, whole-document samples, splits,
and how the trainer's dataset builder and the dataset tools treat them."""

from __future__ import annotations

import numpy as np
import pytest

from diffmeg.data.indexed import (
    IndexedWriter,
    has_loss_mask,
    loss_mask_prefix,
    merge_datasets,
    resolve_prefixes,
)
from diffmeg.data.loss_mask import LossMaskDataset, MaskedDocuments, MaskedWriter, build_loss_mask_datasets
from diffmeg.errors import DiffmegError
from tests.data.helpers import leftovers


def write_masked(prefix, docs: list[list[int]], masks: list[list[int]]) -> str:
    with MaskedWriter(str(prefix), dtype=np.uint16) as w:
        w.add_documents(np.concatenate(docs), np.concatenate(masks), np.array([len(d) for d in docs]))
        w.commit()
    return str(prefix)


def numbered(n: int, length: int = 6) -> tuple[list[list[int]], list[list[int]]]:
    """Document i is [i+1, i+1, ...] with mask bits on its odd positions (recognisable samples)."""
    docs = [[i + 1] * length for i in range(n)]
    masks = [[k % 2 for k in range(length)] for _ in range(n)]
    return docs, masks


def test_round_trip_and_sample_layout(tmp_path):
    docs = [[5, 6, 7, 8], [9, 10, 11]]
    masks = [[0, 1, 0, 1], [0, 0, 1]]
    prefix = write_masked(tmp_path / "d", docs, masks)
    assert has_loss_mask(prefix) and leftovers(tmp_path) == [
        "d.bin",
        "d.idx",
        "d.loss_mask.bin",
        "d.loss_mask.idx",
    ]
    documents = MaskedDocuments(prefix)
    assert [documents.get(i)[0].tolist() for i in range(2)] == docs
    assert [documents.get(i)[1].astype(int).tolist() for i in range(2)] == masks
    ds = LossMaskDataset(documents, np.arange(2), seq_length=4, num_samples=2, seed=0, split_index=0)
    by_doc = {ds.document_index(k): ds[k] for k in range(2)}
    full, short = by_doc[0], by_doc[1]
    # inputs doc[:-1], labels doc[1:], the mask bit of the predicted token; padding has mask 0
    assert full["tokens"].tolist() == [5, 6, 7, 0] and full["labels"].tolist() == [6, 7, 8, 0]
    assert full["loss_mask"].tolist() == [1, 0, 1, 0]
    assert short["tokens"].tolist() == [9, 10, 0, 0] and short["labels"].tolist() == [10, 11, 0, 0]
    assert short["loss_mask"].tolist() == [0, 1, 0, 0]
    assert full["position_ids"].tolist() == [0, 1, 2, 3]


def test_a_document_longer_than_a_sample_is_an_error(tmp_path):
    documents = MaskedDocuments(write_masked(tmp_path / "d", [[1] * 9], [[1] * 9]))
    with pytest.raises(DiffmegError, match="needs --seq-length >= 8"):
        LossMaskDataset(documents, np.arange(1), seq_length=7, num_samples=1, seed=0, split_index=0)


def test_every_epoch_visits_every_document_once_in_a_new_order(tmp_path):
    documents = MaskedDocuments(write_masked(tmp_path / "d", *numbered(10)))
    ds = LossMaskDataset(documents, np.arange(10), seq_length=5, num_samples=30, seed=3, split_index=0)
    assert len(ds) == 30
    epochs = [[ds.document_index(e * 10 + k) for k in range(10)] for e in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]
    assert int(ds[7]["tokens"][0]) == ds.document_index(7) + 1
    again = LossMaskDataset(documents, np.arange(10), seq_length=5, num_samples=30, seed=3, split_index=0)
    assert [again.document_index(k) for k in range(30)] == sum(epochs, [])  # deterministic by seed


def test_splits_are_contiguous_document_blocks(tmp_path):
    prefix = write_masked(tmp_path / "d", *numbered(20))
    train, valid, test = build_loss_mask_datasets([prefix], "80,20,0", 5, seed=1, num_samples=(50, 4, 0))
    assert test is None and len(train) == 50 and len(valid) == 4
    assert sorted({train.document_index(k) for k in range(16)}) == list(range(16))
    assert sorted(valid.document_index(k) for k in range(4)) == [16, 17, 18, 19]


def test_a_mask_that_does_not_match_its_tokens_is_an_error(tmp_path):
    prefix = write_masked(tmp_path / "d", [[1, 2, 3]], [[0, 1, 1]])
    with IndexedWriter(loss_mask_prefix(prefix), dtype=np.uint8) as w:  # a stale mask of another length
        w.add_document(np.array([0, 1], dtype=np.uint8))
        w.commit()
    with pytest.raises(DiffmegError, match="does not match"):
        MaskedDocuments(prefix)


def test_writer_leaves_nothing_when_interrupted(tmp_path):
    with pytest.raises(RuntimeError):
        with MaskedWriter(str(tmp_path / "d"), dtype=np.uint16) as w:
            w.add_documents(np.array([1, 2]), np.array([0, 1]), np.array([2]))
            raise RuntimeError("interrupted")
    assert leftovers(tmp_path) == []


def test_blends_and_mixtures_are_refused(tmp_path):
    a = write_masked(tmp_path / "a", *numbered(4))
    b = write_masked(tmp_path / "b", *numbered(4))
    with IndexedWriter(str(tmp_path / "plain"), dtype=np.uint16) as w:
        w.add_document(np.arange(6, dtype=np.uint16))
        w.commit()
    with pytest.raises(DiffmegError, match="cannot be blended"):
        build_loss_mask_datasets([a, b], "1,0,0", 5, 0, (4, 0, 0))
    with pytest.raises(DiffmegError, match="with and without a loss mask"):
        build_loss_mask_datasets([a, str(tmp_path / "plain")], "1,0,0", 5, 0, (4, 0, 0))


def test_dataset_listings_and_merges_carry_the_mask(tmp_path):
    a = write_masked(tmp_path / "a", *numbered(3))
    b = write_masked(tmp_path / "b", [[7, 8, 9]], [[0, 0, 1]])
    assert resolve_prefixes([str(tmp_path)]) == [a, b]  # the .loss_mask companions are not datasets
    merged = str(tmp_path / "out" / "m")
    (tmp_path / "out").mkdir()
    merge_datasets([a, b], merged)
    docs = MaskedDocuments(merged)
    assert len(docs) == 4 and docs.get(3)[0].tolist() == [7, 8, 9] and docs.get(3)[1].tolist() == [0, 0, 1]
    with IndexedWriter(str(tmp_path / "plain"), dtype=np.uint16) as w:
        w.add_document(np.arange(3, dtype=np.uint16))
        w.commit()
    with pytest.raises(DiffmegError, match="has a loss mask but"):
        merge_datasets([a, str(tmp_path / "plain")], str(tmp_path / "out" / "bad"))


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from diffmeg.data import indexed

    class FullDisk(indexed.IndexedDatasetBuilder):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            real = self.data_file

            class Writer:
                def write(self, data) -> int:
                    raise OSError(errno.ENOSPC, "No space left on device")

                def __getattr__(self, name):
                    return getattr(real, name)

            self.data_file = Writer()

    monkeypatch.setattr(indexed, "IndexedDatasetBuilder", FullDisk)
    with pytest.raises(DiffmegError, match=r"^disk full in .*partial output was removed") as info:
        write_masked(tmp_path / "d", *numbered(3))
    assert "\n" not in str(info.value) and leftovers(tmp_path) == []


def test_temporaries_of_a_killed_writer_are_removed(tmp_path):
    dead = 2**22 + 12345  # beyond pid_max on Linux: never a live process
    stale = [tmp_path / f"d.bin.tmp-{dead}", tmp_path / f"d.loss_mask.idx.tmp-{dead}"]
    for path in stale:
        path.write_bytes(b"partial")
    write_masked(tmp_path / "d", *numbered(2))
    assert not any(p.exists() for p in stale)
    assert len(MaskedDocuments(str(tmp_path / "d"))) == 2
