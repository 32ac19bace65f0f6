"""The MQAR generator (diffmeg/data/mqar.py, tools/make_mqar_data.py): format, vocabulary halves, answers,
held-out splits, and the loss mask it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from diffmeg.data.indexed import loss_mask_prefix
from diffmeg.data.loss_mask import MaskedDocuments
from diffmeg.data.mqar import (
    MQARSetting,
    mqar_document,
    pair_indices,
    read_mqar_metadata,
    write_mqar_dataset,
)
from diffmeg.errors import DiffmegError
from tests.data.helpers import REPO_ROOT, leftovers

SETTINGS = [MQARSetting(8, vocab_size=64), MQARSetting(6, 3, 2, vocab_size=64), MQARSetting(4, 4, 5, 32)]


def parse(setting: MQARSetting, tokens: np.ndarray, mask: np.ndarray):
    """(context pairs {key: value}, distractors, [(query key, answer)]) read back from a document."""
    context, query = tokens[: -2 * setting.num_queries], tokens[-2 * setting.num_queries :]
    half = setting.vocab_size // 2
    pairs, distractors, i = {}, [], 0
    while i < len(context):
        if i + 1 < len(context) and context[i + 1] >= half:  # a key is followed by its value
            pairs[int(context[i])] = int(context[i + 1])
            i += 2
        else:
            distractors.append(int(context[i]))
            i += 1
    queries = [(int(k), int(v)) for k, v in query.reshape(-1, 2)]
    return pairs, distractors, queries


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_documents_have_the_setting_shape_and_consistent_answers(setting):
    half = setting.vocab_size // 2
    for index in range(20):
        tokens, mask = mqar_document(setting, seed=3, index=index)
        assert tokens.shape == mask.shape == (setting.doc_length,)
        pairs, distractors, queries = parse(setting, tokens, mask)
        assert len(pairs) == setting.num_pairs and len(set(pairs.values())) == setting.num_pairs
        assert all(1 <= k < half for k in pairs) and all(
            half <= v < setting.vocab_size for v in pairs.values()
        )
        assert len(distractors) == setting.distractors * setting.num_pairs
        assert all(1 <= d < half and d not in pairs for d in distractors)  # key-like, never a real key
        assert len({k for k, _ in queries}) == setting.num_queries
        assert all(pairs[k] == v for k, v in queries)  # every answer is its key's value in the context
        # the mask marks exactly the answers: the value after each query key
        answers = np.flatnonzero(mask)
        assert len(answers) == setting.num_queries
        assert [int(tokens[p]) for p in answers] == [v for _, v in queries]
        assert all(int(tokens[p - 1]) == k for p, (k, _) in zip(answers, queries, strict=True))


def test_documents_are_deterministic_per_seed_and_index():
    s = SETTINGS[1]
    a, b = mqar_document(s, 0, 5), mqar_document(s, 0, 5)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(mqar_document(s, 0, 6)[0], a[0])
    assert not np.array_equal(mqar_document(s, 1, 5)[0], a[0])


def test_distractor_gaps_vary():
    s = MQARSetting(8, distractors=2, vocab_size=64)
    layouts = {tuple(np.flatnonzero(mqar_document(s, 0, i)[0] >= 32)[:8]) for i in range(20)}
    assert len(layouts) > 1  # value positions differ: distractors are spread at random


def test_setting_names_and_lengths():
    assert MQARSetting(16).name == "kv16" and MQARSetting(16).seq_length == 63
    s = MQARSetting(32, 8, 2, 512)
    assert s.name == "kv32-q8-d2" and s.doc_length == 32 * 4 + 16


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_pairs": 0}, "queries <= pairs"),
        ({"num_pairs": 4, "num_queries": 5}, "queries <= pairs"),
        ({"num_pairs": 4, "distractors": -1}, "distractors"),
        ({"num_pairs": 40, "vocab_size": 64}, "vocab-size >= 82"),
        ({"num_pairs": 31, "distractors": 1, "vocab_size": 64}, "leaves none"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(DiffmegError, match=match):
        MQARSetting(**kwargs)


def test_pair_indices_count_pairs_not_distractors():
    # context k1=1 v1=9, distractor 3, k2=2 v2=10; queries k2, k1 (vocabulary 16: values >= 8)
    doc = np.array([1, 9, 3, 2, 10, 2, 10, 1, 9])
    assert pair_indices(doc, np.array([6, 8]), vocab_size=16).tolist() == [1, 0]


def test_dataset_and_mask_round_trip(tmp_path):
    s = SETTINGS[1]
    prefix = str(tmp_path / "kv")
    meta = write_mqar_dataset(prefix, s, documents=37, seed=4)
    assert leftovers(tmp_path) == sorted(["kv.bin", "kv.idx", "kv.loss_mask.bin", "kv.loss_mask.idx"])
    assert read_mqar_metadata(prefix) == meta and meta["seq_length"] == s.seq_length
    docs = MaskedDocuments(prefix)
    assert len(docs) == 37 and docs.tokens.index.dtype == np.uint16 and docs.mask.index.dtype == np.uint8
    for i in (0, 17, 36):  # chunked writing keeps document i = mqar_document(i)
        tokens, mask = docs.get(i)
        want_tokens, want_mask = mqar_document(s, 4, i)
        assert np.array_equal(tokens, want_tokens) and np.array_equal(mask, want_mask)
    with pytest.raises(DiffmegError, match="already exists"):
        write_mqar_dataset(prefix, s, documents=2, seed=4)


def test_tool_writes_disjoint_heldout_splits(tmp_path):
    prefix = tmp_path / "kv8"
    cmd = [sys.executable, str(REPO_ROOT / "tools" / "make_mqar_data.py"), "--output-prefix", str(prefix)]
    cmd += ["--pairs", "8", "--vocab-size", "64", "--documents", "300", "--heldout-documents", "100"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "train with --seq-length 31" in proc.stdout
    seen = {}
    for name, seed in (("", 0), ("-valid", 1), ("-test", 2)):
        meta = json.loads((tmp_path / f"kv8{name}.mqar.json").read_text())
        assert meta["seed"] == seed and meta["setting"]["num_pairs"] == 8
        docs = MaskedDocuments(str(prefix) + name)
        seen[name] = {tuple(docs.get(i)[0]) for i in range(len(docs))}
        assert len(seen[name]) == len(docs)
    assert (
        not seen[""] & seen["-valid"] and not seen[""] & seen["-test"] and not seen["-valid"] & seen["-test"]
    )
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already exists; pass --overwrite" in again.stderr
    assert (tmp_path / (loss_mask_prefix("kv8") + ".bin")).is_file()
