from __future__ import annotations

import json

import numpy as np
import pytest

from diffmeg.data.gpt_datasets import parse_data_path
from diffmeg.data.indexed import IndexedWriter
from diffmeg.data.upsample import length_upsample, plan_buckets
from diffmeg.errors import DiffmegError
from tests.data.helpers import leftovers, read_documents

T = 100
LENGTHS = [5, 150, 99, 100, 0, 30, 400, 101]  # documents >= T are "long"


def make_corpus(prefix, lengths, offset=0) -> str:
    """Document i holds tokens offset+i (so it can be recognised in any bucket)."""
    with IndexedWriter(str(prefix)) as w:
        for i, n in enumerate(lengths):
            w.add_document(np.full(n, offset + i, dtype=np.int32))
        w.commit()
    return str(prefix)


def test_two_buckets_weights_and_contents(tmp_path):
    a = make_corpus(tmp_path / "a", LENGTHS)
    b = make_corpus(tmp_path / "b", [200, 7], offset=1000)
    result = length_upsample([a, b], str(tmp_path / "up"), target_length=T, long_factor=3.0)
    short, long = result.buckets
    short_docs = [[i] * n for i, n in enumerate(LENGTHS) if n < T] + [[1001] * 7]
    long_docs = [[i] * n for i, n in enumerate(LENGTHS) if n >= T] + [[1000] * 200]
    assert [d.tolist() for d in read_documents(short.prefix)] == short_docs
    assert [d.tolist() for d in read_documents(long.prefix)] == long_docs
    n_short, n_long = sum(map(len, short_docs)), sum(map(len, long_docs))
    assert (short.documents, short.tokens, long.documents, long.tokens) == (5, n_short, 5, n_long)
    assert long.weight == pytest.approx(3 * n_long / (3 * n_long + n_short))
    assert short.weight == pytest.approx(n_short / (3 * n_long + n_short))
    assert long.natural_share == pytest.approx(n_long / (n_long + n_short))
    # the weights file is exactly what --data-path takes
    values = open(result.weights_file).read().split()
    assert values == result.data_path
    prefixes, weights = parse_data_path(values)
    assert prefixes == [short.prefix, long.prefix]
    assert weights == pytest.approx([short.weight, long.weight], rel=1e-5)
    summary = json.load(open(result.summary_file))
    assert summary["buckets"][1]["tokens"] == n_long and summary["data_path"] == values


def test_factor_one_reproduces_the_natural_token_mix(tmp_path):
    a = make_corpus(tmp_path / "a", LENGTHS)
    result = length_upsample([a], str(tmp_path / "up"), target_length=T, long_factor=1.0)
    for bucket in result.buckets:
        assert bucket.weight == pytest.approx(bucket.natural_share)


def test_more_buckets_and_multi_sequence_documents(tmp_path):
    with IndexedWriter(str(tmp_path / "a")) as w:
        w.add_document(np.arange(60, dtype=np.int32), lengths=[20, 40])  # one document, two sequences
        w.add_document(np.arange(10, dtype=np.int32))
        w.add_document(np.arange(500, dtype=np.int32))
        w.commit()
    result = length_upsample([str(tmp_path / "a")], str(tmp_path / "up"), edges=[50, 200], factors=[1, 2, 5])
    assert [b.name for b in result.buckets] == ["short", "mid1", "long"]
    assert [b.documents for b in result.buckets] == [1, 1, 1]
    mid = read_documents(result.buckets[1].prefix)
    assert mid[0].tolist() == list(range(60))
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert IndexedDataset(result.buckets[1].prefix).sequence_lengths.tolist() == [20, 40]
    mass = 10 * 1 + 60 * 2 + 500 * 5
    assert [b.weight for b in result.buckets] == pytest.approx([10 / mass, 120 / mass, 2500 / mass])


def test_empty_bucket_is_left_out(tmp_path):
    a = make_corpus(tmp_path / "a", [5, 10])
    result = length_upsample([a], str(tmp_path / "up"), target_length=T)
    assert result.data_path == ["1", str(tmp_path / "up_short")]
    assert "up_long.bin" not in leftovers(tmp_path)


def test_errors(tmp_path):
    a = make_corpus(tmp_path / "a", LENGTHS)
    with pytest.raises(DiffmegError, match="needs 3 values"):
        plan_buckets("x", T, 2.0, edges=[10, 20], factors=[1, 2])
    with pytest.raises(DiffmegError, match="increasing"):
        plan_buckets("x", T, 2.0, edges=[20, 10])
    with pytest.raises(DiffmegError, match="> 0"):
        plan_buckets("x", T, 0.0)
    with pytest.raises(DiffmegError, match="not found"):
        length_upsample([str(tmp_path / "missing")], str(tmp_path / "up"))
    length_upsample([a], str(tmp_path / "up"), target_length=T)
    with pytest.raises(DiffmegError, match="already exists; pass --overwrite"):
        length_upsample([a], str(tmp_path / "up"), target_length=T)
    length_upsample([a], str(tmp_path / "up"), target_length=T, overwrite=True)
