"""A generated multi-needle training corpus in token ids, for toy-scale retrieval experiments on a CPU.

Every document is one needle prompt of the evaluation's own format (`diffmeg.eval.needle`, the
`IdVocab` of the model's vocabulary), followed by its answer and an end-of-document id, and is exactly
`seq_length` tokens long. A GPT sample is `seq_length + 1` consecutive tokens, so each training window
holds one whole document (plus the next one's first token): the model sees the question at the end of
its window and learns to continue it with the queried numbers. Needle counts, query counts and the
depth of the first queried needle vary per document; the filler is random ids, so only the needles,
the templates and the answers can be learned. The evaluation draws its prompts from other seeds
(`tools/eval_needle.py --seed`), and numbers come from 9M values, so answers cannot be memorised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from diffmeg.data.indexed import IndexedWriter, check_can_write
from diffmeg.errors import DiffmegError
from diffmeg.eval.needle import IdVocab, build_prompt

SEED_OFFSET = 1_000_000_007
"""Document i of a corpus with seed s is built from seed SEED_OFFSET * (s + 1) + i: far from the small
seeds the evaluation tools use."""


@dataclass
class NeedleCorpusConfig:
    output_prefix: str
    vocab_size: int
    seq_length: int
    documents: int
    needles: Sequence[int] = (1, 2, 3, 4, 5, 6)
    queries: Sequence[int] = (1, 2)
    seed: int = 0
    overwrite: bool = False


def needle_document(vocab: IdVocab, cfg: NeedleCorpusConfig, index: int) -> np.ndarray:
    """Document `index`: prompt, answer and end-of-document id, `seq_length` tokens in all."""
    seed = SEED_OFFSET * (cfg.seed + 1) + index
    rng = np.random.default_rng(seed)
    n = int(rng.choice(cfg.needles))
    r = int(rng.choice([q for q in cfg.queries if q <= n]))
    depth = float(rng.random())
    # The answer's length depends on R only (ids per number and the separator), not on the numbers.
    answer_len = r * vocab.value_len + (r - 1) * len(vocab.separator)
    prompt = build_prompt(vocab, cfg.seq_length - answer_len - 1, depth, n, r, seed=seed)
    eod = cfg.vocab_size - 1
    doc = np.concatenate([prompt.tokens, np.asarray(prompt.answer + [eod], dtype=np.int64)])
    assert len(doc) == cfg.seq_length, (len(doc), cfg.seq_length)
    return doc


def write_needle_corpus(cfg: NeedleCorpusConfig) -> tuple[int, int]:
    """Write the corpus as an indexed dataset (atomically); returns (documents, tokens)."""
    if cfg.documents < 1:
        raise DiffmegError(f"--documents must be >= 1, got {cfg.documents}")
    if not cfg.needles or min(cfg.needles) < 1 or not cfg.queries or min(cfg.queries) < 1:
        raise DiffmegError("--needles and --queries take positive counts")
    if min(cfg.queries) > max(cfg.needles):
        raise DiffmegError(
            f"no query count in {list(cfg.queries)} fits the needle counts {list(cfg.needles)}"
        )
    vocab = IdVocab(cfg.vocab_size)
    check_can_write([cfg.output_prefix], cfg.overwrite)
    dtype = np.uint16 if cfg.vocab_size <= 65536 else np.int32
    with IndexedWriter(cfg.output_prefix, dtype=dtype) as writer:
        batch: list[np.ndarray] = []
        for i in range(cfg.documents):
            batch.append(needle_document(vocab, cfg, i))
            if len(batch) == 4096 or i == cfg.documents - 1:
                writer.add_documents(np.concatenate(batch), np.full(len(batch), cfg.seq_length))
                batch = []
        writer.commit()
        return writer.documents, writer.tokens
