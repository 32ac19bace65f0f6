from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil

import pytest
import tiktoken

from diffmeg.data import tiktoken_cl100k as tok_module
from diffmeg.data.tiktoken_cl100k import (
    CL100K_N_VOCAB,
    CL100K_URL,
    EOD_ID,
    PAD_ID,
    PADDED_VOCAB_SIZE,
    TOKENIZER_FILE_ENV,
    load_tokenizer,
)
from diffmeg.errors import DiffmegError

TEXTS = [
    "Hello, world! The Differential Transformer cancels attention noise.",
    "naïve café — 日本語のテキスト 🙂🚀 and Ελληνικά",
    "   leading spaces\n\n\ttabs and\r\nwindows newlines   ",
    "special-token text stays text: <|endoftext|> <|fim_prefix|>",
    "def f(x):\n    return x ** 2  # code 12345678901234",
    "",
]


@pytest.fixture
def no_tokenizer_sources(monkeypatch, tmp_path):
    """No env var, an empty tiktoken cache, no network, and a fresh per-process cache."""
    monkeypatch.delenv(TOKENIZER_FILE_ENV, raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tok_module, "_host_reachable", lambda *a, **k: False)
    monkeypatch.setattr(tok_module, "_ENCODINGS", {})


def test_constants_and_special_ids(tokenizer):
    assert (CL100K_N_VOCAB, EOD_ID, PADDED_VOCAB_SIZE) == (100277, 100257, 100288)
    assert PADDED_VOCAB_SIZE % 64 == 0 and PADDED_VOCAB_SIZE - 64 < CL100K_N_VOCAB <= PADDED_VOCAB_SIZE
    assert tokenizer.vocab_size == PADDED_VOCAB_SIZE
    assert tokenizer.eod == EOD_ID == tokenizer.encoding.eot_token
    assert tokenizer.pad == PAD_ID and CL100K_N_VOCAB <= tokenizer.pad < PADDED_VOCAB_SIZE
    assert tokenizer.encoding.n_vocab == CL100K_N_VOCAB
    assert tokenizer.encoding.encode("<|endoftext|>", allowed_special="all") == [EOD_ID]


def test_tokenize_is_encode_ordinary_and_round_trips(tokenizer):
    for text in TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids == tokenizer.encoding.encode_ordinary(text)
        assert tokenizer.detokenize(ids) == text
        assert EOD_ID not in ids and tokenizer.pad not in ids
    # ids outside tiktoken's table (padding rows, unused ids) decode to nothing instead of raising
    assert tokenizer.detokenize(tokenizer.tokenize("ab") + [PAD_ID, 100256, PADDED_VOCAB_SIZE - 1]) == "ab"


def test_matches_tiktoken_get_encoding(bpe_file, monkeypatch, tmp_path):
    """Our loader must give exactly tiktoken's own cl100k_base (pattern, ranks, special tokens)."""
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    shutil.copy(bpe_file, cache / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.delenv(TOKENIZER_FILE_ENV, raising=False)
    monkeypatch.setattr(tok_module, "_ENCODINGS", {})
    reference = tiktoken.get_encoding("cl100k_base")
    from_file = load_tokenizer(bpe_file)
    from_cache = load_tokenizer()  # tiktoken's cache path, no network needed
    assert from_cache.source == "<tiktoken cache>"
    assert from_file.encoding._special_tokens == reference._special_tokens
    assert from_file.encoding._pat_str == reference._pat_str
    for text in TEXTS:
        expected = reference.encode_ordinary(text)
        assert from_file.tokenize(text) == expected == from_cache.tokenize(text)


def test_env_var_and_per_path_cache(bpe_file, monkeypatch):
    monkeypatch.setenv(TOKENIZER_FILE_ENV, bpe_file)
    a, b = load_tokenizer(), load_tokenizer(bpe_file)
    assert a.source == os.path.realpath(bpe_file)
    assert a.encoding is b.encoding  # loaded once per path per process


def test_explicit_file_wins_over_env(bpe_file, monkeypatch, tmp_path):
    monkeypatch.setenv(TOKENIZER_FILE_ENV, str(tmp_path / "nonexistent.tiktoken"))
    assert load_tokenizer(bpe_file).source == os.path.realpath(bpe_file)


def test_sha_mismatch_is_a_clear_error(bpe_file, tmp_path):
    bad = tmp_path / "cl100k_base.tiktoken"
    data = bytearray(open(bpe_file, "rb").read())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    with pytest.raises(DiffmegError, match="sha256") as info:
        load_tokenizer(str(bad))
    assert "\n" not in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKENIZER_FILE_ENV, str(tmp_path / "missing.tiktoken"))
    with pytest.raises(DiffmegError, match=f"cannot read tokenizer file .*{TOKENIZER_FILE_ENV}"):
        load_tokenizer()


def test_nothing_available_fails_fast_with_instructions(no_tokenizer_sources, monkeypatch):
    """Fast: the unreachable host is found by one probe, no download (tiktoken's retries) is attempted."""

    def download(*args, **kwargs):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(tiktoken, "get_encoding", download)
    with pytest.raises(DiffmegError) as info:
        load_tokenizer()
    message = str(info.value)
    assert "--tokenizer-file" in message and TOKENIZER_FILE_ENV in message and "\n" not in message


def test_pickle_reloads_by_path(tokenizer, monkeypatch):
    payload = pickle.dumps(tokenizer)
    assert len(payload) < 1000  # the path, not the 1.7 MB table
    monkeypatch.setattr(tok_module, "_ENCODINGS", {})  # as in a fresh worker process
    clone = pickle.loads(payload)
    assert clone.tokenize(TEXTS[1]) == tokenizer.tokenize(TEXTS[1])
    assert clone.unique_identifiers == tokenizer.unique_identifiers


def test_unique_identifiers_name_the_vocabulary_not_the_file(tokenizer):
    ids = json.loads(json.dumps(tokenizer.unique_identifiers))
    assert ids["vocab_size"] == PADDED_VOCAB_SIZE and ids["eod"] == EOD_ID
    assert not any(os.sep in str(v) for v in ids.values())
    assert tokenizer.vocab[b"<|endoftext|>"] == EOD_ID
    assert tokenizer.inv_vocab[tokenizer.tokenize("hello")[0]] == b"hello"
