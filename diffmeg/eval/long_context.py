"""The paper's long-context evaluation: cumulative average negative log-likelihood by token position.

A model that uses long context well predicts tokens late in a document better than early ones, so the
average NLL up to position p keeps falling as p grows. For every document at least `min_doc_length`
tokens long, the first `length + 1` tokens give `length` predictions; position p (0-based) is token
p + 1 predicted from tokens 0..p. NLLs are summed by position over documents, averaged per position,
and reported as the cumulative average over positions 0..p, for each checkpoint on the same
documents.

It streams: one batch of documents at a time, and the output projection and cross entropy run over
sequence chunks of the final hidden states, so a 64K-token document never materialises its full
[s, b, vocab] logits (26 GB in float32 for cl100k). Only per-position sums and counts are kept.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

from diffmeg.checkpoints import first_line
from diffmeg.data.indexed import strip_ext
from diffmeg.data.tiktoken_cl100k import PADDED_VOCAB_SIZE
from diffmeg.data.tokenizers import text_tokenizer
from diffmeg.errors import DiffmegError, stderr
from diffmeg.eval.common import (
    EvalConfig,
    Log,
    eod_id,
    expand_text_files,
    loaded_models,
    read_text_file,
    start_outputs,
    write_json,
)
from diffmeg.eval.plotting import Curve, plot_curves
from diffmeg.model import output_logits
from diffmeg.model_source import CheckpointInfo
from diffmeg.storage import atomic_write

CSV_NAME = "long_context_nll.csv"
PLOT_NAME = "long_context_nll.png"
SUMMARY_NAME = "summary.json"


# ----------------------------------------------------------------------------------------------------
# Position statistics


def cumulative_average(values: np.ndarray) -> np.ndarray:
    """out[p] = mean(values[0..p]): the paper's curve from the per-position mean NLL."""
    values = np.asarray(values, dtype=np.float64)
    return np.cumsum(values) / np.arange(1, len(values) + 1)


@dataclass
class PositionStats:
    """Sums and counts of per-token NLL by position, accumulated one batch of documents at a time."""

    length: int
    sums: np.ndarray = field(init=False)
    counts: np.ndarray = field(init=False)
    documents: int = 0

    def __post_init__(self) -> None:
        self.sums = np.zeros(self.length, dtype=np.float64)
        self.counts = np.zeros(self.length, dtype=np.int64)

    def add(self, nll: np.ndarray, valid: Sequence[int]) -> None:
        """Add a batch: `nll` [b, s<=length]; row i counts only at positions < valid[i]."""
        nll = np.asarray(nll, dtype=np.float64)
        for row, n in zip(nll, valid, strict=True):
            self.sums[:n] += row[:n]
            self.counts[:n] += 1
            self.documents += 1

    @property
    def tokens(self) -> int:
        """Predictions scored (each document contributes one per position it reaches)."""
        return int(self.counts.sum())

    @property
    def covered(self) -> int:
        """Positions reached by at least one document (a prefix: documents start at position 0)."""
        return int(np.count_nonzero(self.counts))

    def mean_by_position(self) -> np.ndarray:
        """Average over documents of the NLL at each covered position."""
        n = self.covered
        return self.sums[:n] / self.counts[:n]

    def cumulative(self) -> np.ndarray:
        """Cumulative average of the per-position means, positions 0..p (each position weighs one)."""
        return cumulative_average(self.mean_by_position())


# ----------------------------------------------------------------------------------------------------
# Documents


class DocumentSource:
    """Documents with known lengths whose first tokens can be read one at a time."""

    description: str
    lengths: np.ndarray

    def name(self, index: int) -> str:
        """How messages refer to document `index`."""
        raise NotImplementedError

    def key(self, index: int) -> int | str:
        """How summary.json records document `index` (its dataset index, or its file)."""
        raise NotImplementedError

    def read(self, index: int, count: int) -> np.ndarray:
        """The first `count` tokens of document `index` (fewer if it is shorter), as int64."""
        raise NotImplementedError


class IndexedDocuments(DocumentSource):
    """A megatron-core indexed dataset (`{prefix}.bin/.idx`), read lazily through its memory map."""

    def __init__(self, prefix: str) -> None:
        prefix = strip_ext(prefix)
        missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not os.path.isfile(p)]
        if missing:
            raise DiffmegError(f"--data-prefix {prefix}: missing {' and '.join(missing)}")
        try:
            self._dataset = IndexedDataset(prefix)
        except Exception as exc:  # a truncated or foreign index raises many types
            raise DiffmegError(f"cannot read indexed dataset {prefix}: {first_line(exc)}") from None
        self.description = f"indexed dataset {prefix}"
        self._doc_index = np.asarray(self._dataset.document_indices, dtype=np.int64)
        seq_lengths = np.asarray(self._dataset.sequence_lengths, dtype=np.int64)
        ends = np.concatenate([[0], np.cumsum(seq_lengths)])
        self.lengths = ends[self._doc_index[1:]] - ends[self._doc_index[:-1]]
        self._seq_lengths = seq_lengths

    def name(self, index: int) -> str:
        return f"document {index}"

    def key(self, index: int) -> int:
        return index

    def read(self, index: int, count: int) -> np.ndarray:
        parts, need = [], count
        for seq in range(self._doc_index[index], self._doc_index[index + 1]):
            if need <= 0:
                break
            take = min(need, int(self._seq_lengths[seq]))
            parts.append(np.asarray(self._dataset.get(seq, offset=0, length=take), dtype=np.int64))
            need -= take
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class TextDocuments(DocumentSource):
    """Plain-text files, each one document, tokenized with cl100k_base (kept in memory: small)."""

    def __init__(self, paths: Sequence[str], tokenizer) -> None:
        self._paths = list(paths)
        self._tokens: list[np.ndarray] = []
        for path in self._paths:
            self._tokens.append(np.asarray(tokenizer.tokenize(read_text_file(path)), dtype=np.int64))
        self.lengths = np.array([len(t) for t in self._tokens], dtype=np.int64)
        self.description = f"{len(self._paths)} text file(s)"

    def name(self, index: int) -> str:
        return self._paths[index]

    def key(self, index: int) -> str:
        return self._paths[index]

    def read(self, index: int, count: int) -> np.ndarray:
        return self._tokens[index][:count]


def select_documents(lengths: np.ndarray, min_length: int, num_docs: int | None, seed: int) -> np.ndarray:
    """Indices (ascending) of documents with at least `min_length` tokens; a seeded sample of
    `num_docs` of them when there are more, so a corpus concatenated from sources is not judged
    on its first source alone."""
    lengths = np.asarray(lengths)
    eligible = np.flatnonzero(lengths >= min_length)
    if len(eligible) == 0:
        longest = int(lengths.max()) if len(lengths) else 0
        raise DiffmegError(
            f"no document has at least {min_length} tokens: {len(lengths)} document(s), the longest "
            f"has {longest}; lower --max-length or --min-doc-length, or use longer documents"
        )
    if num_docs is not None and len(eligible) > num_docs:
        eligible = np.sort(np.random.default_rng(seed).choice(eligible, size=num_docs, replace=False))
    return eligible


# ----------------------------------------------------------------------------------------------------
# Checkpoints


def resolve_length(infos: Sequence[CheckpointInfo], max_length: int | None, log: Log) -> int:
    """The evaluated context: `max_length`, else the shortest training length among the checkpoints."""
    lengths = {i.seq_length for i in infos}
    if max_length is None:
        max_length = min(lengths)
        if len(lengths) > 1:
            log(
                f"warning: checkpoints were trained at different lengths {sorted(lengths)}; evaluating "
                f"{max_length} tokens (pass --max-length to choose)"
            )
    for info in infos:
        if max_length > info.seq_length:
            log(
                f"warning: --max-length {max_length} exceeds {info.label or info.root}'s training length "
                f"{info.seq_length}: positions beyond it measure extrapolation"
            )
    return max_length


# ----------------------------------------------------------------------------------------------------
# The model side


@torch.no_grad()
def final_hidden_states(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The final normed hidden states [s, b, h] of inputs [b, s] at positions 0..s-1: what the output
    projection (`diffmeg.model.output_logits`) turns into logits, for callers that need only some
    positions.

    GPTModel's `_postprocess` returns the decoder output when `post_process` is off; the decoder keeps
    its own final norm, so only the output projection is skipped (and can be done in chunks).
    """
    b, s = inputs.shape
    position_ids = torch.arange(s, device=inputs.device).unsqueeze(0).expand(b, s)
    saved, model.post_process = model.post_process, False
    try:
        return model(input_ids=inputs, position_ids=position_ids, attention_mask=None)
    finally:
        model.post_process = saved


@torch.no_grad()
def per_token_nll(
    model: torch.nn.Module, tokens: torch.Tensor, chunk_size: int | None = 4096
) -> torch.Tensor:
    """NLL of tokens[:, 1:] given their prefixes: [b, s+1] token ids -> [b, s] float32.

    The same loss megatron-core computes with `labels=` (its cross entropy), but the vocabulary
    projection runs over `chunk_size` positions at a time with float32 logits (also for a bf16
    model), so peak memory holds chunk x b x vocab logits, not s x b x vocab. `chunk_size=None`
    uses the `labels=` path directly (logits in the model's dtype).
    """
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    b, s = inputs.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    if chunk_size is None:
        loss = model(input_ids=inputs, position_ids=position_ids, attention_mask=None, labels=labels)
        return loss.float()
    hidden = final_hidden_states(model, inputs)  # [s, b, h]
    out = torch.empty(b, s, dtype=torch.float32, device=tokens.device)
    for start in range(0, s, chunk_size):
        stop = min(s, start + chunk_size)
        logits = output_logits(model, hidden[start:stop])  # [c, b, V]
        out[:, start:stop] = model.compute_language_model_loss(labels[:, start:stop], logits.float())
        del logits
    return out


def _check_token_ids(source: DocumentSource, index: int, tokens: np.ndarray, vocab_size: int) -> None:
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens.max()) if tokens.max() >= vocab_size else int(tokens.min())
        raise DiffmegError(
            f"{source.name(index)} of {source.description} holds token id {bad}, outside the "
            f"checkpoint's vocabulary of {vocab_size}: was it tokenized for another model?"
        )


def evaluate_model(
    model: torch.nn.Module,
    source: DocumentSource,
    indices: np.ndarray,
    length: int,
    *,
    vocab_size: int,
    batch_size: int = 1,
    chunk_size: int | None = 4096,
    log: Log = stderr,
    label: str = "",
    prefix: int | None = None,
) -> PositionStats:
    """Per-position NLL sums of `model` over documents `indices`, each cut to `length + 1` tokens; with
    a `prefix` token id (lm-eval's way), that token and the first `length` tokens of each document, so
    position p is document token p given the prefix and tokens 0..p-1."""
    device = next(model.parameters()).device
    stats = PositionStats(length)
    started = last_log = time.monotonic()
    for start in range(0, len(indices), batch_size):
        batch = indices[start : start + batch_size]
        docs = [source.read(int(i), length + (prefix is None)) for i in batch]
        for i, doc in zip(batch, docs, strict=True):
            _check_token_ids(source, int(i), doc, vocab_size)
        if prefix is not None:
            docs = [np.concatenate([[prefix], doc]) for doc in docs]
        width = max(len(d) for d in docs)
        padded = np.zeros((len(docs), width), dtype=np.int64)  # a causal model never sees the padding
        for row, doc in enumerate(docs):
            padded[row, : len(doc)] = doc
        nll = per_token_nll(model, torch.from_numpy(padded).to(device), chunk_size)
        stats.add(nll.cpu().numpy(), [len(d) - 1 for d in docs])
        now = time.monotonic()
        if now - last_log > 30 or stats.documents == len(indices):
            rate = stats.tokens / max(now - started, 1e-9)
            log(
                f"{label}: {stats.documents}/{len(indices)} documents, {stats.tokens} tokens, "
                f"{rate:.0f} tokens/s, running NLL {stats.sums.sum() / max(stats.tokens, 1):.4f}"
            )
            last_log = now
    return stats


# ----------------------------------------------------------------------------------------------------
# Outputs


def csv_positions(length: int, every: int) -> np.ndarray:
    """Row positions kept in the CSV: 0, every `every`-th (>= 1: `LongContextConfig` checked it), and the
    last."""
    rows = np.arange(0, length, every)
    if length and rows[-1] != length - 1:
        rows = np.append(rows, length - 1)
    return rows


def write_csv(path: str, columns: dict[str, np.ndarray], every: int = 1) -> None:
    """`position,label1,label2,...` with the cumulative average NLL, atomically."""
    length = min(len(v) for v in columns.values())
    with atomic_write(path, newline="") as f:
        rows = csv.writer(f, lineterminator="\n")  # labels quoted where they hold a comma or a quote
        rows.writerow(["position", *columns])
        rows.writerows([p, *(f"{v[p]:.6f}" for v in columns.values())] for p in csv_positions(length, every))


# ----------------------------------------------------------------------------------------------------
# The whole evaluation


@dataclass
class LongContextConfig(EvalConfig):
    """One evaluation run (the tool's flags)."""

    data_prefix: str | None = None
    text_files: list[str] | None = None
    tokenizer_file: str | None = None
    max_length: int | None = None
    min_doc_length: int | None = None
    num_docs: int | None = 100
    batch_size: int = 1
    loss_chunk_size: int | None = 4096
    csv_every: int = 1
    prefix_eod: bool = False
    """Put the end-of-document token before every document, as lm-eval's `loglikelihood_rolling` does,
    so the first document token is scored too and sums compare with lm-eval's per document."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.data_prefix is None) == (not self.text_files):
            raise DiffmegError("give exactly one of --data-prefix or --text-files")
        self.require_positive("max_length", "num_docs", "batch_size", "loss_chunk_size", "csv_every")
        if self.min_doc_length is not None and self.min_doc_length < 2:
            raise DiffmegError(
                f"--min-doc-length must be >= 2 (one prediction needs two tokens), got {self.min_doc_length}"
            )


def _document_source(cfg: LongContextConfig, info: CheckpointInfo) -> DocumentSource:
    if cfg.data_prefix is not None:
        return IndexedDocuments(cfg.data_prefix)

    if info.tokenizer == "mock" or (info.tokenizer == "cl100k_base" and info.vocab_size < PADDED_VOCAB_SIZE):
        raise DiffmegError(
            f"--text-files are tokenized with cl100k_base, but {info.root} was trained on {info.tokenizer} "
            f"ids with vocab {info.vocab_size}; evaluate it on an indexed dataset with --data-prefix"
        )
    paths = expand_text_files(cfg.text_files or [])
    return TextDocuments(paths, text_tokenizer(info.args, cfg.tokenizer_file))  # cl100k_base or its own


def run_long_context_eval(cfg: LongContextConfig, log: Log = stderr) -> dict:
    """Evaluate every checkpoint on the same documents; write the CSV, the plot and summary.json.

    Everything that can be checked cheaply (flags, output directory, checkpoint arguments, data,
    matplotlib) is checked before the first model is loaded. Returns the summary.
    """
    start_outputs(cfg.output_dir, cfg.plot)
    infos = cfg.checkpoints.resolve()
    length = resolve_length(infos, cfg.max_length, log)
    scored = length + (not cfg.prefix_eod)  # document tokens read per document
    min_doc_length = cfg.min_doc_length if cfg.min_doc_length is not None else scored
    source = _document_source(cfg, infos[0])
    indices = select_documents(source.lengths, min_doc_length, cfg.num_docs, cfg.seed)
    log(
        f"evaluating {len(infos)} checkpoint(s) on {len(indices)} document(s) of {source.description} "
        f"(>= {min_doc_length} tokens; {int((source.lengths >= min_doc_length).sum())} eligible), "
        f"{length} positions"
    )

    for i in indices:  # every evaluated token is a row of the embedding: checked before any model loads
        _check_token_ids(source, int(i), source.read(int(i), scored), infos[0].vocab_size)
    prefix = eod_id(infos[0]) if cfg.prefix_eod else None

    results: list[tuple[CheckpointInfo, PositionStats, float]] = []
    started = time.monotonic()
    for info, model in loaded_models(infos, cfg.dtype, cfg.seed):
        stats = evaluate_model(
            model,
            source,
            indices,
            length,
            vocab_size=info.vocab_size,
            batch_size=cfg.batch_size,
            chunk_size=cfg.loss_chunk_size,
            log=log,
            label=info.label,
            prefix=prefix,
        )
        results.append((info, stats, time.monotonic() - started))  # loading included
        started = time.monotonic()

    covered = min(stats.covered for _, stats, _ in results)
    if covered < length:
        log(f"warning: no selected document reaches past position {covered - 1}; the curves stop there")
    curves = {info.label: stats.cumulative()[:covered] for info, stats, _ in results}
    write_csv(os.path.join(cfg.output_dir, CSV_NAME), curves, cfg.csv_every)
    if cfg.plot:
        x = np.arange(1, covered + 1)
        plot_curves(
            [Curve(label, x, y) for label, y in curves.items()],
            os.path.join(cfg.output_dir, PLOT_NAME),
            xlabel="tokens of context (position + 1)",
            ylabel="cumulative average NLL",
            title=f"Long-context NLL, {len(indices)} documents",
            logx=True,
            vlines=[(n, f"trained length {n}") for n in sorted({i.seq_length for i in infos}) if n < covered],
        )
    summary = {
        "length": length,
        "positions": covered,
        "min_doc_length": min_doc_length,
        "data": source.description,
        "documents": [source.key(int(i)) for i in indices],
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "csv_every": cfg.csv_every,
        "prefix_eod": prefix,
        "checkpoints": [
            {
                **info.identity(),
                "trained_seq_length": info.seq_length,
                "extrapolated": length > info.seq_length,
                "docs_used": stats.documents,
                "tokens_evaluated": stats.tokens,
                "final_cumulative_nll": float(curves[info.label][-1]),
                "mean_nll_per_token": float(stats.sums.sum() / max(stats.tokens, 1)),
                "seconds": round(seconds, 2),
                "args": info.args,
            }
            for info, stats, seconds in results
        ],
    }
    write_json(os.path.join(cfg.output_dir, SUMMARY_NAME), summary)
    return summary
