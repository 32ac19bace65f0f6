"""The generated needle corpus: whole documents in the evaluation's format, one per training window."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from diffmeg.data.tiktoken_cl100k import IdTokenizer
from diffmeg.errors import DiffmegError
from diffmeg.eval.needle import IdVocab
from diffmeg.eval.needle_corpus import NeedleCorpusConfig, needle_document, write_needle_corpus
from tests.slurm.helpers import REPO_ROOT

VOCAB, SEQ = 256, 96


def _config(tmp_path, **kw) -> NeedleCorpusConfig:
    return NeedleCorpusConfig(str(tmp_path / "needles"), VOCAB, SEQ, **{"documents": 40, **kw})


def test_documents_are_whole_prompts_with_their_answers(tmp_path):
    cfg = _config(tmp_path, needles=(2, 4), queries=(1, 2), seed=3)
    vocab = IdVocab(VOCAB)
    seen_r = set()
    for i in range(cfg.documents):
        doc = needle_document(vocab, cfg, i)
        assert len(doc) == SEQ and doc[-1] == VOCAB - 1 and doc.max() < VOCAB and doc.min() >= 0
        # The question opens with the template "q"; the cities queried follow it, then the answer.
        q = vocab.question([])[:3]
        starts = [j for j in range(SEQ - 3) if doc[j : j + 3].tolist() == q]
        assert starts, i
        tail = doc[starts[-1] + 3 : -1].tolist()
        a_template = vocab.question([])[3:]
        cut = next(j for j in range(len(tail)) if tail[j : j + 3] == a_template)
        cities, answer = tail[:cut], tail[cut + 3 :]
        r = len(cities) // vocab.key_len
        seen_r.add(r)
        # Each queried city's needle is in the context and the answer holds its number, in order.
        numbers = []
        for k in range(r):
            key = cities[k * vocab.key_len : (k + 1) * vocab.key_len]
            head = vocab._templates["pre"] + key + vocab._templates["mid"]
            at = next(j for j in range(starts[-1]) if doc[j : j + len(head)].tolist() == head)
            numbers.append(doc[at + len(head) : at + len(head) + vocab.value_len].tolist())
        assert answer == sum((n + (vocab.separator if k < r - 1 else []) for k, n in enumerate(numbers)), [])
    assert seen_r == {1, 2}


def test_the_corpus_is_deterministic_and_written_atomically(tmp_path):
    cfg = _config(tmp_path)
    assert write_needle_corpus(cfg) == (40, 40 * SEQ)
    first = IndexedDataset(cfg.output_prefix)
    assert len(first) == 40 and first[0].dtype == np.uint16
    with pytest.raises(DiffmegError, match="already exists"):
        write_needle_corpus(cfg)
    (tmp_path / "again").mkdir()
    (tmp_path / "other").mkdir()
    again, other = _config(tmp_path / "again"), _config(tmp_path / "other", seed=1)
    write_needle_corpus(again)
    write_needle_corpus(other)
    second = IndexedDataset(again.output_prefix)
    assert all(np.array_equal(first[i], second[i]) for i in range(40))
    third = IndexedDataset(other.output_prefix)  # kept alive: its arrays are views of its mmap
    assert not np.array_equal(first[0], third[0])


def test_every_training_window_holds_one_whole_document(tmp_path, single_rank_parallel_state):
    from diffmeg.data.gpt_datasets import build_gpt_datasets

    cfg = _config(tmp_path, documents=64)
    write_needle_corpus(cfg)
    stored = IndexedDataset(cfg.output_prefix)
    docs = {tuple(stored[i].tolist()) for i in range(64)}
    train, _, _ = build_gpt_datasets(
        [cfg.output_prefix], "1,0,0", SEQ, 5, (40, 0, 0), IdTokenizer(VOCAB), str(tmp_path / "cache")
    )
    for i in range(40):
        sample = train[i]
        tokens = sample["tokens"].tolist() + sample["labels"][-1:].tolist()
        assert tuple(tokens[:SEQ]) in docs
        assert float(sample["loss_mask"].min()) == 1.0  # no id is taken for padding


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"documents": 0}, "--documents must be >= 1"),
        ({"queries": (3,), "needles": (1, 2)}, "no query count"),
        ({"needles": (0,)}, "positive counts"),
    ],
)
def test_bad_settings_are_one_line_errors(tmp_path, kw, match):
    with pytest.raises(DiffmegError, match=match):
        write_needle_corpus(_config(tmp_path, **kw))
    assert not list(tmp_path.iterdir())


def test_tool_cli(tmp_path):
    prefix = tmp_path / "c"
    argv = [
        sys.executable,
        str(REPO_ROOT / "tools" / "make_needle_corpus.py"),
        "--output-prefix",
        str(prefix),
    ]
    argv += ["--vocab-size", "128", "--seq-length", "64", "--documents", "10"]
    ok = subprocess.run(argv, capture_output=True, text=True)
    assert ok.returncode == 0 and "10 documents, 640 tokens" in ok.stdout, ok.stderr
    again = subprocess.run(argv, capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0 and "--overwrite" in again.stderr
