from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os

import pytest

from diffmeg.data import builtin
from diffmeg.data.tiktoken_cl100k import EOD_ID, load_tokenizer
from diffmeg.storage import CACHE_DIR_ENV
from tests.data.helpers import read_documents


def _build_in_child(bpe_file: str, cache_dir: str, results) -> None:
    try:
        results.put(("ok", builtin.builtin_corpus(load_tokenizer(bpe_file), cache_dir=cache_dir)))
    except BaseException as exc:  # report, do not hang the test
        results.put(("error", repr(exc)))


@pytest.fixture(scope="module")
def built(tmp_path_factory, bpe_file):
    """Two processes build the corpus into one empty cache at the same time."""
    cache = str(tmp_path_factory.mktemp("diffmeg-cache"))
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(bpe_file, cache, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    return cache, outcomes


def test_concurrent_first_build(built):
    cache, outcomes = built
    assert [o[0] for o in outcomes] == ["ok", "ok"], outcomes
    assert outcomes[0][1] == outcomes[1][1]
    prefix = outcomes[0][1]
    assert prefix.startswith(os.path.join(cache, "builtin")) and prefix.endswith("builtin_text_document")
    entry = os.path.dirname(prefix)
    assert sorted(os.listdir(entry)) == [
        "builtin.jsonl",
        "builtin_text_document.bin",
        "builtin_text_document.ids.json",  # its token-id range, checked against a run's vocabulary
        "builtin_text_document.idx",
        "builtin_text_document.tokenizer.json",  # which ids: cl100k_base
    ]


def test_corpus_is_real_text_tokenized_with_eod(built, tokenizer):
    prefix = built[1][0][1]
    documents = read_documents(prefix)
    with open(os.path.join(os.path.dirname(prefix), "builtin.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(documents) == len(texts) > 1000
    assert sum(len(t.encode()) for t in texts) > 1_000_000  # megabytes of English prose
    assert sum(len(d) for d in documents) > 300_000
    for i in (0, 1, len(texts) // 2, len(texts) - 1):
        assert documents[i].tolist() == tokenizer.tokenize(texts[i]) + [EOD_ID]


def test_cached_after_first_build(built, tokenizer):
    cache, outcomes = built
    prefix = outcomes[0][1]
    mtime = os.stat(prefix + ".bin").st_mtime_ns
    assert builtin.builtin_corpus(tokenizer, cache_dir=cache) == prefix
    assert os.stat(prefix + ".bin").st_mtime_ns == mtime  # found, not built again


def test_generation_is_deterministic():
    first = list(itertools.islice(builtin.iter_documents(), 300))
    again = list(itertools.islice(builtin.iter_documents(), 300))
    assert first == again and all(doc.strip() for doc in first)
    assert builtin.corpus_key() == builtin.corpus_key()


def test_data_path_builtin(built, gloo, tokenizer, monkeypatch, tmp_path):
    from diffmeg.data.gpt_datasets import build_gpt_datasets

    monkeypatch.setenv(CACHE_DIR_ENV, built[0])
    train, valid, test = build_gpt_datasets(
        ["builtin"], "969,30,1", 64, 1234, (100, 10, 10), tokenizer, str(tmp_path / "idx-cache")
    )
    assert len(train) >= 100 and len(valid) >= 10 and len(test) >= 10
    assert train[0]["tokens"].shape == (64,)


def test_first_build_says_so_and_about_how_long(tmp_path, monkeypatch, capsys):
    """Issue 16, item 9: the wait before the first training line is explained when it starts."""
    steps = []
    monkeypatch.setattr(builtin, "write_jsonl", lambda path: steps.append("jsonl") or (0, 0))
    monkeypatch.setattr(builtin, "preprocess", lambda cfg, log: steps.append("tokenize"))
    builtin.builtin_corpus(None, cache_dir=str(tmp_path))
    err = capsys.readouterr().err
    assert err.startswith(
        f"building the builtin corpus (first use: about {builtin.BUILD_CPU_SECONDS} s on an idle"
    )
    assert "later runs reuse it" in err and steps == ["jsonl", "tokenize"]


def test_too_little_text_writes_nothing(tmp_path, monkeypatch):
    """The size check fails inside the atomic write: neither the corpus nor its temporary is left."""
    monkeypatch.setattr(builtin, "iter_documents", lambda: iter(["a short document"]))
    target = tmp_path / "corpus.jsonl"
    with pytest.raises(builtin.DiffmegError, match=r"^this Python install has only 16 bytes of doc"):
        builtin.write_jsonl(str(target))
    assert os.listdir(tmp_path) == []
