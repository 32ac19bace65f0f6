"""The paper's tokenizer: tiktoken ``cl100k_base`` with exact ids, as a megatron-core tokenizer.

Ids are tiktoken's unchanged (``<|endoftext|>`` = 100257 ends every document), and the embedding
table is padded from 100277 to 100288 rows (a multiple of 64). The BPE file is found, in order:
an explicit path (``--tokenizer-file``), ``$DIFFMEG_TOKENIZER_FILE``, tiktoken's own cache or
download. Local files are checked against tiktoken's sha256 so a wrong or truncated file can never
produce silently different token ids.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import tiktoken
import tiktoken_ext.openai_public as public
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from diffmeg.errors import DiffmegError

CL100K_N_VOCAB = 100277
"""Ids tiktoken's cl100k_base can produce or decode: 0..100276 (with a few unused holes)."""
EOD_ID = 100257
"""``<|endoftext|>``: appended after every document (``--append-eod``)."""
PADDED_VOCAB_SIZE = 100288
"""Embedding rows: CL100K_N_VOCAB rounded up to a multiple of 64."""
PAD_ID = CL100K_N_VOCAB
"""Padding id: the first padded row (100277). The tokenizer never emits it, so megatron-core can
mask it from the loss without ever masking a real token (using EOD as pad would mask every EOD)."""
TOKENIZER_FILE_ENV = "DIFFMEG_TOKENIZER_FILE"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"

_HOW_TO_FIX = (
    f"pass --tokenizer-file /path/to/cl100k_base.tiktoken or set {TOKENIZER_FILE_ENV} "
    f"(the file is {CL100K_URL}, sha256 {CL100K_SHA256[:12]}...)"
)
_TIKTOKEN_SOURCE = "<tiktoken cache>"
_ENCODINGS: dict[str, tiktoken.Encoding] = {}
_LOCK = threading.Lock()
_PATCH_LOCK = threading.Lock()


class Cl100kTokenizer(MegatronLegacyTokenizer):
    """cl100k_base for megatron-core's datasets and our tools.

    GPTDataset reads ``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers`` (the latter goes
    into its index-cache key, so it names the vocabulary, never the file's location). Pickling
    sends only where the BPE came from; a worker process reloads it (cached per process).

    megatron-core 0.16.1 calls this base class ``MegatronLegacyTokenizer``; its ``__init__`` only
    logs a deprecation warning and records the constructor arguments, so we set the identifiers
    ourselves instead of calling it.
    """

    def __init__(self, encoding: tiktoken.Encoding, source: str | None = None) -> None:
        if encoding.n_vocab != CL100K_N_VOCAB or encoding.eot_token != EOD_ID:
            raise DiffmegError(
                f"tokenizer has n_vocab={encoding.n_vocab}, eot={encoding.eot_token}; "
                f"expected cl100k_base ({CL100K_N_VOCAB}, {EOD_ID}): {_HOW_TO_FIX}"
            )
        self._encoding = encoding
        self._source = source
        self._vocab: dict[bytes, int] | None = None
        self._inv_vocab: dict[int, bytes] | None = None
        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("encoding", "cl100k_base"),
                ("sha256", CL100K_SHA256),
                ("vocab_size", PADDED_VOCAB_SIZE),
                ("eod", EOD_ID),
                ("pad", PAD_ID),
            ]
        )
        self.unique_description = repr(dict(self.unique_identifiers))

    def __reduce__(self):
        return load_tokenizer, (None if self._source == _TIKTOKEN_SOURCE else self._source,)

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The underlying tiktoken Encoding (for batch encoding and special tokens)."""
        return self._encoding

    @property
    def source(self) -> str | None:
        """The BPE file this tokenizer was loaded from, or ``"<tiktoken cache>"``."""
        return self._source

    def tokenize(self, text: str) -> list[int]:
        """Plain-text encoding: special-token strings in the text are encoded as ordinary text."""
        return self._encoding.encode_ordinary(text)

    def detokenize(self, ids: Sequence[int] | np.ndarray) -> str:
        """Decode, dropping ids tiktoken has no bytes for (padding rows and unused ids).

        A model can sample any of its 100288 rows; a decoder that raised on those would make
        generation fail for no useful reason.
        """
        known = self.inv_vocab
        return self._encoding.decode([int(i) for i in ids if int(i) in known])

    @property
    def vocab(self) -> dict[bytes, int]:
        """Token bytes -> id, for the ids tiktoken defines (special tokens as their text)."""
        if self._vocab is None:
            vocab = {}
            for token_id in range(CL100K_N_VOCAB):
                try:
                    vocab[self._encoding.decode_single_token_bytes(token_id)] = token_id
                except KeyError:
                    continue  # unused id inside cl100k's range
            self._vocab = vocab
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, bytes]:
        """Id -> token bytes."""
        if self._inv_vocab is None:
            self._inv_vocab = {v: k for k, v in self.vocab.items()}
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        """Padded size (100288): the embedding rows, and what GPTDataset uses to pick int32."""
        return PADDED_VOCAB_SIZE

    @property
    def eod(self) -> int:
        return EOD_ID

    @property
    def pad(self) -> int:
        return PAD_ID


class IdTokenizer(MegatronLegacyTokenizer):
    """No tokenizer: datasets that already hold ids below ``vocab_size`` (``--tokenizer-type null``).

    What GPTDataset needs and nothing more. The end-of-document id is the last one by convention
    (generated corpora write it there); no id pads, so no label is ever masked as padding.
    """

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = int(vocab_size)
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self._vocab_size)]
        )
        self.unique_description = repr(dict(self.unique_identifiers))

    def tokenize(self, text: str) -> list[int]:
        raise DiffmegError("--tokenizer-type null reads token ids; it has no text tokenizer")

    def detokenize(self, ids: Sequence[int] | np.ndarray) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self._vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: str(i) for i in range(self._vocab_size)}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    @property
    def pad(self) -> int:
        return -1  # never a stored id: GPTDataset masks labels equal to pad


def load_tokenizer(tokenizer_file: str | None = None) -> Cl100kTokenizer:
    """cl100k_base from ``tokenizer_file``, else ``$DIFFMEG_TOKENIZER_FILE``, else tiktoken's cache.

    Raises DiffmegError (one line saying what to pass) when none of them works; an offline machine
    fails in about a second instead of waiting on a network timeout.
    """
    path = tokenizer_file or os.environ.get(TOKENIZER_FILE_ENV) or None
    if path is not None:
        path = os.path.realpath(os.path.expanduser(path))
        return Cl100kTokenizer(_cached(path, lambda: _encoding_from_file(path, tokenizer_file)), path)
    return Cl100kTokenizer(_cached(_TIKTOKEN_SOURCE, _encoding_from_tiktoken), _TIKTOKEN_SOURCE)


def _cached(key: str, make) -> tiktoken.Encoding:
    with _LOCK:
        if key not in _ENCODINGS:
            _ENCODINGS[key] = make()
        return _ENCODINGS[key]


def _encoding_from_file(path: str, explicit: str | None) -> tiktoken.Encoding:
    origin = "--tokenizer-file" if explicit else TOKENIZER_FILE_ENV
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise DiffmegError(f"cannot read tokenizer file {path} (from {origin}): {exc.strerror}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != CL100K_SHA256:
        raise DiffmegError(
            f"tokenizer file {path} (from {origin}) has sha256 {digest[:12]}..., not cl100k_base's "
            f"{CL100K_SHA256[:12]}...: download it again from {CL100K_URL}"
        )
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(**_cl100k_spec(ranks))


def _cl100k_spec(ranks: dict[bytes, int]) -> dict:
    """tiktoken's own cl100k_base definition (pattern, special tokens) with our verified ranks.

    tiktoken only exposes the definition through a constructor that downloads the ranks, so its
    loader is swapped for one returning ours for the duration of the call (under a lock).
    """
    with _PATCH_LOCK:
        original = public.load_tiktoken_bpe
        public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
        try:
            return public.cl100k_base()
        finally:
            public.load_tiktoken_bpe = original


def _tiktoken_cache_file() -> str | None:
    """Where tiktoken would cache cl100k_base (mirrors tiktoken.load.read_file_cached)."""
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if cache_dir is None:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if cache_dir == "":
        return None
    return os.path.join(cache_dir, hashlib.sha1(CL100K_URL.encode()).hexdigest())


def _host_reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _encoding_from_tiktoken() -> tiktoken.Encoding:
    cache_file = _tiktoken_cache_file()
    cached = cache_file is not None and os.path.isfile(cache_file)
    if not cached and not _host_reachable("openaipublic.blob.core.windows.net"):
        raise DiffmegError(f"cl100k_base is not in tiktoken's cache and cannot be downloaded: {_HOW_TO_FIX}")
    try:
        return tiktoken.get_encoding("cl100k_base")
    except Exception as exc:  # network errors, hash mismatch of a download, unwritable cache
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DiffmegError(f"tiktoken could not load cl100k_base ({reason}): {_HOW_TO_FIX}") from None
