from __future__ import annotations

import numpy as np
import pytest

from diffmeg.data.gpt_datasets import build_gpt_datasets, epoch_note, parse_data_path
from diffmeg.data.indexed import IndexedWriter
from diffmeg.data.tokenizers import NULL, build_tokenizer
from diffmeg.errors import DiffmegError
from tests.data.helpers import write_dataset


def make_dataset(prefix, n_docs: int, token: int, length: int = 50) -> str:
    """n_docs documents of ``length`` copies of ``token`` (so a sample's source is recognisable)."""
    with IndexedWriter(str(prefix)) as w:
        for _ in range(n_docs):
            w.add_document(np.full(length, token, dtype=np.int32))
        w.commit()
    return str(prefix)


@pytest.fixture(scope="module")
def two_prefixes(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    return make_dataset(d / "a", 400, token=11), make_dataset(d / "b", 300, token=22)


def test_parse_data_path(two_prefixes):
    a, b = two_prefixes
    assert parse_data_path([a]) == ([a], None)
    assert parse_data_path(["0.3", a, "7", b]) == ([a, b], [0.3, 7.0])
    assert parse_data_path(["builtin"]) == (["builtin"], None)  # built on first use


@pytest.mark.parametrize(
    "values,match",
    [
        ([], "empty"),
        (["0.3", "A", "0.7"], "has 3 values"),
        (["A", "B"], "weight 'A' is not a number"),
        (["-1", "A"], "must be > 0"),
        (["0", "A"], "must be > 0"),
        (["nan", "A"], "must be > 0"),
    ],
)
def test_parse_data_path_errors(values, match):
    with pytest.raises(DiffmegError, match=match):
        parse_data_path(values)


def test_parse_data_path_missing_files(two_prefixes, tmp_path):
    a, _ = two_prefixes
    with pytest.raises(DiffmegError, match=r"missing .*nope\.bin and .*nope\.idx"):
        parse_data_path([str(tmp_path / "nope")])
    with pytest.raises(DiffmegError, match="without the extension"):
        parse_data_path([a + ".bin"])
    (tmp_path / "half.idx").write_bytes(b"")
    with pytest.raises(DiffmegError, match=r"missing \S*half\.bin$"):
        parse_data_path(["1", a, "1", str(tmp_path / "half")])


def test_blend_draws_in_proportion_to_weights(gloo, tokenizer, two_prefixes, tmp_path):
    a, b = two_prefixes
    train, valid, test = build_gpt_datasets(
        ["0.25", a, "0.75", b], "90,8,2", 32, 1234, (2000, 200, 50), tokenizer, str(tmp_path / "cache")
    )
    for dataset, size in ((train, 2000), (valid, 200), (test, 50)):
        counts = np.bincount(np.asarray(dataset.dataset_index), minlength=2)
        assert counts.sum() == len(dataset) >= size
        assert abs(counts[0] - 0.25 * len(dataset)) <= 1 and abs(counts[1] - 0.75 * len(dataset)) <= 1
    for i in range(0, 200, 7):  # each sample really comes from the dataset the index names
        sample = train[i]
        token = 11 if int(sample["dataset_id"]) == 0 else 22
        assert set(sample["tokens"].tolist()) <= {token} and sample["tokens"].shape == (32,)


def test_order_is_deterministic_and_seeded(gloo, tokenizer, two_prefixes, tmp_path):
    a, _ = two_prefixes
    args = ([a], "98,1,1", 16)
    first, _, _ = build_gpt_datasets(*args, 7, (500, 10, 10), tokenizer, str(tmp_path / "c1"))
    again, _, _ = build_gpt_datasets(*args, 7, (500, 10, 10), tokenizer, str(tmp_path / "c2"))
    other, _, _ = build_gpt_datasets(*args, 8, (500, 10, 10), tokenizer, str(tmp_path / "c3"))
    order = lambda ds: [int(ds.shuffle_index[i]) for i in range(len(ds))]  # noqa: E731
    assert order(first) == order(again) and order(first) != order(other)
    for k in (0, 123, 499):  # resuming at consumed sample k reads the same sample
        assert first[k]["tokens"].tolist() == again[k]["tokens"].tolist()


def test_zero_document_split_fails_instead_of_hanging(gloo, tokenizer, tmp_path):
    small = make_dataset(tmp_path / "small", 3, token=5)
    with pytest.raises(DiffmegError, match=r"the valid split of \S*small no documents .*'969,0,0'"):
        build_gpt_datasets([small], "969,30,1", 8, 1, (10, 10, 10), tokenizer, str(tmp_path / "c"))
    train, valid, test = build_gpt_datasets(
        [small], "1,0,0", 8, 1, (10, 0, 0), tokenizer, str(tmp_path / "c")
    )
    assert len(train) >= 10 and valid is None and test is None


@pytest.mark.parametrize("asked, noted", [(124, False), (125, True), (126, False), (248, False)])
def test_a_train_split_exceeded_by_a_sliver_is_noted(tmp_path, gloo, asked, noted):
    prefix = write_dataset(tmp_path / "d", [[3] * 50] * 40)  # 2000 tokens: 124 samples of 16 (+1) an epoch
    tokenizer = build_tokenizer(NULL, vocab_size=64)
    train, _, _ = build_gpt_datasets([prefix], "1,0,0", 16, 1, (asked, 0, 0), tokenizer, str(tmp_path / "c"))
    note = epoch_note(train, train_iters=asked)  # one sample per iteration
    if not noted:
        assert note is None
        return
    assert note == (
        f"note: {prefix}'s train split holds 124 samples and the run asks {asked}: 2 epochs are indexed for "
        f"{100 * (asked / 124 - 1):.2f}% more; --train-iters 124 stays in one epoch"
    )
