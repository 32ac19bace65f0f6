"""The exported Hugging Face tokenizer gives tiktoken's cl100k_base ids exactly, special tokens included."""

from __future__ import annotations

import json
import random

import pytest

from tests.data.helpers import find_bpe_file

SAMPLES = [
    "Héllo wörld! 你好，世界。Привет, мир! 🙂🚀 👨‍👩‍👧‍👦 naïve café ﬁ ß ÆØÅ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 العربية हिन्दी 日本語のテキスト 한국어 ελληνικά עברית ไทย",
    "code:\n\tx = 1_000_000 + 3.14e-5;  // 'll 'VE 're I'M\r\n  trailing   \n\n\n",
    "   leading spaces, \u00a0no-break, \u200bzero-width, \ufeffbom, tabs\t\t\tand a lone \r",
    "12345678901234567890 numbers 3.14159 and $100,000.00 !!! ??? ... ---",
    "<|endoftext|> written as text, <|fim_prefix|> too",
    "",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from diffmeg.conversion.checkpoint_io import save_hf_tokenizer
    from diffmeg.conversion.tokenizer_export import build_fast_tokenizer
    from diffmeg.data.tiktoken_cl100k import load_tokenizer

    tokenizer_file = find_bpe_file()
    if tokenizer_file is None:
        pytest.skip("cl100k_base BPE file not found; set DIFFMEG_TOKENIZER_FILE")
    directory = tmp_path_factory.mktemp("tokenizer")
    encoding = load_tokenizer(tokenizer_file).encoding
    save_hf_tokenizer(build_fast_tokenizer(encoding, model_max_length=4096), str(directory))
    from transformers import AutoTokenizer

    return directory, encoding, AutoTokenizer.from_pretrained(str(directory))


def random_texts(count: int, seed: int = 0) -> list[str]:
    """Mixed scripts, digits, punctuation and every kind of whitespace run, to exercise the split regex."""
    pieces = list("aZé漢ß😀١٢3 0\n\t\r\u00a0'.,!?-_$") + ["'s", "'LL", " the", "\r\n", "   ", "123456"]
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 60))) for _ in range(count)]


def test_auto_tokenizer_encodes_like_tiktoken(exported):
    directory, encoding, tokenizer = exported
    for text in SAMPLES:
        expected = encoding.encode_ordinary(text) if "<|" not in text else None
        ids = tokenizer.encode(text, add_special_tokens=True)
        if expected is not None:
            assert ids == expected, text
            assert tokenizer.decode(ids) == text
    long_text = " ".join(SAMPLES) * 20
    assert tokenizer.encode(long_text) == encoding.encode(long_text, allowed_special="all")
    texts = random_texts(500)
    assert tokenizer(texts)["input_ids"] == encoding.encode_ordinary_batch(texts)


def test_special_tokens_keep_their_tiktoken_ids(exported):
    directory, encoding, tokenizer = exported
    for text in sorted(encoding.special_tokens_set):
        assert tokenizer.convert_tokens_to_ids(text) == encoding.encode_single_token(text), text
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == encoding.eot_token == 100257
    text = "a<|endoftext|>b<|endofprompt|>"
    assert tokenizer.encode(text) == encoding.encode(text, allowed_special="all")
    assert tokenizer.decode([100257]) == "<|endoftext|>"
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
