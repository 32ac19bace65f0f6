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

import gc
import glob
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from diffmeg.checkpoints import (
    DTYPES,
    CheckpointInfo,
    first_line,
    load_checkpoint_model,
    read_checkpoint_info,
)
from diffmeg.errors import DiffmegError
from diffmeg.runtime import single_process

CSV_NAME = "long_context_nll.csv"
PLOT_NAME = "long_context_nll.png"
SUMMARY_NAME = "summary.json"

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
        from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

        if prefix.endswith((".bin", ".idx")):
            prefix = prefix[:-4]
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
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            except OSError as exc:
                raise DiffmegError(f"cannot read text file {path}: {exc.strerror}") from None
            self._tokens.append(np.asarray(tokenizer.tokenize(text), dtype=np.int64))
        self.lengths = np.array([len(t) for t in self._tokens], dtype=np.int64)
        self.description = f"{len(self._paths)} text file(s)"

    def name(self, index: int) -> str:
        return self._paths[index]

    def key(self, index: int) -> str:
        return self._paths[index]

    def read(self, index: int, count: int) -> np.ndarray:
        return self._tokens[index][:count]


def expand_text_files(patterns: Sequence[str]) -> list[str]:
    """Files matching each glob (sorted), or the path itself; each file once, in the order given."""
    paths: list[str] = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        found = [p for p in found if os.path.isfile(p)]
        if not found:
            raise DiffmegError(f"--text-files {pattern!r} matches no file")
        paths.extend(p for p in found if p not in paths)
    return paths


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


def check_same_vocabulary(infos: Sequence[CheckpointInfo]) -> None:
    """Checkpoints on one plot must read the same token ids the same way."""
    first = infos[0]
    for other in infos[1:]:
        if (other.tokenizer, other.vocab_size) != (first.tokenizer, first.vocab_size):
            raise DiffmegError(
                f"checkpoints use different tokenizers/vocabularies: {first.root} ({first.tokenizer}, "
                f"vocab {first.vocab_size}) vs {other.root} ({other.tokenizer}, vocab {other.vocab_size}); "
                "compare checkpoints trained with the same tokenizer"
            )


def default_labels(infos: Sequence[CheckpointInfo]) -> list[str]:
    """`DIFF (dirname)` / `Transformer (dirname)`, made unique by iteration, then by order."""

    def name(info: CheckpointInfo) -> str:
        return os.path.basename(os.path.normpath(info.root)) or info.root

    labels = [f"{i.architecture} ({name(i)})" for i in infos]
    if len(set(labels)) < len(labels):
        labels = [f"{i.architecture} ({name(i)} @ {'hf' if i.hf else i.iteration})" for i in infos]
    if len(set(labels)) < len(labels):
        labels = [f"{label} #{k + 1}" for k, label in enumerate(labels)]
    return labels


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


@contextmanager
def _hidden_states_only(model: torch.nn.Module) -> Iterator[None]:
    """Make GPTModel.forward return the final (normed) hidden states instead of logits or loss.

    GPTModel's `_postprocess` returns the decoder output when `post_process` is off; the decoder keeps
    its own final norm, so only the output projection is skipped and can be done in chunks here.
    """
    saved = model.post_process
    model.post_process = False
    try:
        yield
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
    with _hidden_states_only(model):
        hidden = model(input_ids=inputs, position_ids=position_ids, attention_mask=None)  # [s, b, h]
    out = torch.empty(b, s, dtype=torch.float32, device=tokens.device)
    for start in range(0, s, chunk_size):
        stop = min(s, start + chunk_size)
        logits, _ = model.output_layer(hidden[start:stop])  # [c, b, V]
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


def check_token_ids(source: DocumentSource, indices: np.ndarray, length: int, vocab_size: int) -> None:
    """Every evaluated token is a row of the embedding (checked before any model is loaded)."""
    for i in indices:
        _check_token_ids(source, int(i), source.read(int(i), length + 1), vocab_size)


def _batches(indices: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(indices), batch_size):
        yield indices[start : start + batch_size]


def evaluate_model(
    model: torch.nn.Module,
    source: DocumentSource,
    indices: np.ndarray,
    length: int,
    *,
    vocab_size: int,
    batch_size: int = 1,
    chunk_size: int | None = 4096,
    log: Log = _stderr,
    label: str = "",
) -> PositionStats:
    """Per-position NLL sums of `model` over documents `indices`, each cut to `length + 1` tokens."""
    device = next(model.parameters()).device
    stats = PositionStats(length)
    started = last_log = time.monotonic()
    for batch in _batches(indices, batch_size):
        docs = [source.read(int(i), length + 1) for i in batch]
        for i, doc in zip(batch, docs, strict=True):
            _check_token_ids(source, int(i), doc, vocab_size)
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
    """Row positions kept in the CSV: 0, every `every`-th, and the last."""
    if every < 1:
        raise DiffmegError(f"--csv-every must be >= 1, got {every}")
    rows = np.arange(0, length, every)
    if length and rows[-1] != length - 1:
        rows = np.append(rows, length - 1)
    return rows


def write_csv(path: str, columns: dict[str, np.ndarray], every: int = 1) -> None:
    """`position,label1,label2,...` with the cumulative average NLL, atomically."""
    length = min(len(v) for v in columns.values())
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(",".join(["position", *(_csv_field(k) for k in columns)]) + "\n")
        for p in csv_positions(length, every):
            f.write(",".join([str(p), *(f"{v[p]:.6f}" for v in columns.values())]) + "\n")
    os.replace(tmp, path)


def _csv_field(text: str) -> str:
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\n') else text


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def prepare_output_dir(path: str) -> None:
    """Create the output directory and prove it writable before hours of evaluation."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DiffmegError(f"--output-dir {path} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise DiffmegError(f"--output-dir {path} is not writable: {exc.strerror}") from None


# ----------------------------------------------------------------------------------------------------
# The whole evaluation


@dataclass
class LongContextConfig:
    """One evaluation run (the tool's flags)."""

    loads: list[str]
    labels: list[str] | None = None
    iterations: list[int] | None = None
    data_prefix: str | None = None
    text_files: list[str] | None = None
    tokenizer_file: str | None = None
    max_length: int | None = None
    min_doc_length: int | None = None
    num_docs: int | None = 100
    seed: int = 1234
    batch_size: int = 1
    loss_chunk_size: int | None = 4096
    csv_every: int = 1
    output_dir: str = "long_context_eval"
    dtype: str = "float32"
    plot: bool = True


def _validate(cfg: LongContextConfig) -> None:
    if not cfg.loads:
        raise DiffmegError("give at least one --load")
    if (cfg.data_prefix is None) == (not cfg.text_files):
        raise DiffmegError("give exactly one of --data-prefix or --text-files")
    if cfg.labels and len(cfg.labels) != len(cfg.loads):
        raise DiffmegError(f"{len(cfg.labels)} --label value(s) for {len(cfg.loads)} --load; give one each")
    if cfg.labels and len(set(cfg.labels)) != len(cfg.labels):
        raise DiffmegError(f"--label values must be distinct, got {cfg.labels}")
    if cfg.iterations and len(cfg.iterations) not in (1, len(cfg.loads)):
        raise DiffmegError(f"--iteration takes one value, or one per --load ({len(cfg.loads)})")
    for name in ("max_length", "num_docs", "batch_size", "loss_chunk_size", "csv_every"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise DiffmegError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if cfg.min_doc_length is not None and cfg.min_doc_length < 2:
        raise DiffmegError(
            f"--min-doc-length must be >= 2 (one prediction needs two tokens), got {cfg.min_doc_length}"
        )
    if cfg.dtype not in DTYPES:
        raise DiffmegError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype}")


def _document_source(cfg: LongContextConfig, info: CheckpointInfo) -> DocumentSource:
    if cfg.data_prefix is not None:
        return IndexedDocuments(cfg.data_prefix)
    from diffmeg.data.tokenizer import PADDED_VOCAB_SIZE, load_tokenizer

    if info.tokenizer != "cl100k_base" or info.vocab_size < PADDED_VOCAB_SIZE:
        raise DiffmegError(
            f"--text-files are tokenized with cl100k_base, but {info.root} was trained on {info.tokenizer} "
            f"ids with vocab {info.vocab_size}; evaluate it on an indexed dataset with --data-prefix"
        )
    paths = expand_text_files(cfg.text_files or [])
    return TextDocuments(paths, load_tokenizer(cfg.tokenizer_file))


def run_long_context_eval(cfg: LongContextConfig, log: Log = _stderr) -> dict:
    """Evaluate every checkpoint on the same documents; write the CSV, the plot and summary.json.

    Everything that can be checked cheaply (flags, output directory, checkpoint arguments, data,
    matplotlib) is checked before the first model is loaded. Returns the summary.
    """
    _validate(cfg)
    prepare_output_dir(cfg.output_dir)
    if cfg.plot:
        from diffmeg.eval.plotting import require_matplotlib

        require_matplotlib()
    iterations = cfg.iterations or [None]
    if len(iterations) == 1:
        iterations = iterations * len(cfg.loads)
    infos = [read_checkpoint_info(root, it) for root, it in zip(cfg.loads, iterations, strict=True)]
    check_same_vocabulary(infos)
    for info, label in zip(infos, cfg.labels or default_labels(infos), strict=True):
        info.label = label
    length = resolve_length(infos, cfg.max_length, log)
    min_doc_length = cfg.min_doc_length if cfg.min_doc_length is not None else length + 1
    source = _document_source(cfg, infos[0])
    indices = select_documents(source.lengths, min_doc_length, cfg.num_docs, cfg.seed)
    log(
        f"evaluating {len(infos)} checkpoint(s) on {len(indices)} document(s) of {source.description} "
        f"(>= {min_doc_length} tokens; {int((source.lengths >= min_doc_length).sum())} eligible), "
        f"{length} positions"
    )

    check_token_ids(source, indices, length, infos[0].vocab_size)

    single_process(cfg.seed)
    results: list[tuple[CheckpointInfo, PositionStats, float]] = []
    for info in infos:
        started = time.monotonic()
        model = load_checkpoint_model(info, DTYPES[cfg.dtype])
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
        )
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        results.append((info, stats, time.monotonic() - started))

    covered = min(stats.covered for _, stats, _ in results)
    if covered < length:
        log(f"warning: no selected document reaches past position {covered - 1}; the curves stop there")
    curves = {info.label: stats.cumulative()[:covered] for info, stats, _ in results}
    write_csv(os.path.join(cfg.output_dir, CSV_NAME), curves, cfg.csv_every)
    if cfg.plot:
        from diffmeg.eval.plotting import Curve, plot_curves

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
        "checkpoints": [
            {
                "label": info.label,
                "load": info.root,
                "iteration": info.iteration,
                "architecture": info.architecture,
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
    _write_json(os.path.join(cfg.output_dir, SUMMARY_NAME), summary)
    return summary


__all__ = [
    "CSV_NAME",
    "PLOT_NAME",
    "SUMMARY_NAME",
    "DocumentSource",
    "IndexedDocuments",
    "LongContextConfig",
    "PositionStats",
    "TextDocuments",
    "check_token_ids",
    "cumulative_average",
    "csv_positions",
    "evaluate_model",
    "per_token_nll",
    "run_long_context_eval",
    "select_documents",
]
