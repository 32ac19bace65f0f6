"""Fixtures for the tool tests: the same BPE file and tokenizer as the data tests."""

from tests.data.conftest import bpe_file, tokenizer  # noqa: F401
from tests.eval.conftest import tiny_ckpts  # noqa: F401, E402
