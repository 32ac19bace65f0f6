"""A Hugging Face tokenizer folder as a megatron-core tokenizer: Megatron-LM's
`--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`.

A model upcycled or imported from a Hugging Face folder keeps the source's vocabulary, so its data must be
tokenized with the source's tokenizer, not cl100k_base. The folder is read with transformers'
`AutoTokenizer` (local files only, no remote code). Ids are the tokenizer's own; a document is encoded
as the tokenizer encodes text with its special tokens (Llama: `<s>` first), and `--append-eod` appends
its end-of-sequence token (the end-of-document id). No id pads (pad = -1): no label is ever masked as
padding.

`fingerprint` names the vocabulary (token -> id, added tokens included), so a checkpoint, a dataset and a
run can be checked to use the same ids wherever the folder lives.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from diffmeg.errors import DiffmegError

HF_TOKENIZER = "HuggingFaceTokenizer"
"""The `--tokenizer-type` of a Hugging Face tokenizer folder (Megatron-LM's name)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""The files transformers' tokenizers are saved as (whichever of them a folder has)."""
_MODEL_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""At least one of these holds the vocabulary itself (tokenizer_config.json alone does not)."""
_LOADED: dict[str, Any] = {}


def has_tokenizer_files(directory: str) -> bool:
    """The folder holds a tokenizer's vocabulary (not only a model's config)."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in _MODEL_FILES)


def copy_tokenizer_files(source: str, destination: str) -> list[str]:
    """Copy the tokenizer files of `source` into `destination` (created) byte for byte; their names."""
    os.makedirs(destination, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(destination, name))  # mode follows the umask
            copied.append(name)
    return copied


def _auto_tokenizer(path: str):
    """transformers' tokenizer of a local folder (cached per process), or a one-line error."""
    path = os.path.realpath(os.path.expanduser(path))
    if path in _LOADED:
        return _LOADED[path]
    if not os.path.isdir(path):
        raise DiffmegError(f"--tokenizer-model {path} is not a directory (a Hugging Face tokenizer folder)")
    if not has_tokenizer_files(path):
        raise DiffmegError(
            f"--tokenizer-model {path} holds no tokenizer ({', '.join(_MODEL_FILES)}); point it at the "
            f"Hugging Face model or tokenizer folder"
        )
    try:
        from transformers import AutoTokenizer  # optional heavy dependency
    except ImportError:
        raise DiffmegError(
            "--tokenizer-type HuggingFaceTokenizer needs transformers (the `hf` extra)"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # many types: a damaged file, a tokenizer class that needs remote code
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise DiffmegError(f"cannot load the Hugging Face tokenizer in {path}: {reason}") from None
    _LOADED[path] = tokenizer
    return tokenizer


def vocabulary_fingerprint(tokenizer) -> str:
    """sha256 of the vocabulary (every token -> id, added tokens included): equal ids, equal fingerprint."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


class HFTokenizer(MegatronLegacyTokenizer):
    """A Hugging Face tokenizer folder for megatron-core's datasets and our tools.

    What GPTDataset reads (`vocab_size`, `eod`, `pad`, `unique_identifiers`) plus `tokenize` (text without
    special tokens, like cl100k's `encode_ordinary`), `encode_document` (what preprocessing stores) and
    `detokenize`. Pickling sends the folder's path; a worker process reloads it.
    """

    def __init__(self, path: str) -> None:  # noqa: D107 (megatron-core's __init__ only logs; see Cl100kTokenizer)
        self._path = os.path.realpath(os.path.expanduser(path))
        self._tokenizer = _auto_tokenizer(self._path)
        eos = self._tokenizer.eos_token_id
        if eos is None:
            raise DiffmegError(
                f"the tokenizer in {self._path} has no end-of-sequence token, which ends every document"
            )
        self._eod = int(eos)
        self._fingerprint = vocabulary_fingerprint(self._tokenizer)
        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("fingerprint", self._fingerprint),
                ("vocab_size", self.vocab_size),
                ("eod", self._eod),
            ]
        )
        self.unique_description = repr(dict(self.unique_identifiers))

    def __reduce__(self):
        return HFTokenizer, (self._path,)

    @property
    def source(self) -> str:
        """The folder the tokenizer was loaded from."""
        return self._path

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def hf_tokenizer(self):
        """transformers' tokenizer object."""
        return self._tokenizer

    def tokenize(self, text: str) -> list[int]:
        """Plain-text encoding, no special tokens added (the counterpart of cl100k's `encode_ordinary`)."""
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Documents as the tokenizer encodes text for a model (its special tokens, e.g. Llama's `<s>`)."""
        if not texts:
            return []  # transformers' batch call fails on an empty batch
        return [list(ids) for ids in self._tokenizer(list(texts), add_special_tokens=True)["input_ids"]]

    def detokenize(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self._tokenizer.get_vocab())

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (added tokens included): the embedding needs at least this many."""
        return len(self._tokenizer)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._tokenizer.bos_token_id

    @property
    def pad(self) -> int:
        return -1  # never a stored id: GPTDataset masks labels equal to pad
