"""Accuracy on loss-masked data such as MQAR: is each masked token the model's greedy prediction?

One forward pass per batch of documents (teacher forcing: every answer is predicted from the true
document before it, as in training). Position p with mask bit 1 is answered correctly when the argmax
over the whole vocabulary of the logits at p - 1 is token p. Reported per checkpoint and dataset:
accuracy over all answers, accuracy by answer index within the document (for MQAR the query's place in
the query section), and for MQAR datasets (PREFIX.mqar.json present) by the queried pair's place in
the context (0 = the first pair, farthest from its query on average). Documents are evaluated in
dataset order: the first ``max_documents``, so every checkpoint sees the same ones. With ``attention``
the same forward passes also read the attention at the answers (`diffmeg.eval.mqar_attention`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from diffmeg.checkpoints import iteration_dirs
from diffmeg.data.gpt_datasets import parse_data_path
from diffmeg.data.indexed import has_loss_mask, loss_mask_prefix, strip_ext
from diffmeg.data.loss_mask import MaskedDocuments
from diffmeg.data.mqar import pair_indices, read_mqar_metadata
from diffmeg.errors import DiffmegError, stderr
from diffmeg.eval.common import EvalConfig, Log, loaded_models, start_outputs, write_json, write_rows
from diffmeg.eval.mqar_attention import AttentionTally, write_attention
from diffmeg.model_source import read_checkpoint_info

SUMMARY_NAME = "mqar_summary.json"
CSV_NAME = "mqar_accuracy.csv"


@dataclass
class Tally:
    """Correct and total answers, overall and by a per-answer key (answer index, pair index)."""

    correct: int = 0
    total: int = 0
    by_query: dict[int, list[int]] = field(default_factory=dict)
    by_pair: dict[int, list[int]] = field(default_factory=dict)

    def add(self, hits: np.ndarray, query_index: np.ndarray, pair_index: np.ndarray | None) -> None:
        """One document's answers: hits[k] for its k-th answer; its query and pair indices."""
        self.correct += int(hits.sum())
        self.total += len(hits)
        for table, keys in ((self.by_query, query_index), (self.by_pair, pair_index)):
            if keys is None:
                continue
            for key, hit in zip(keys.tolist(), hits.tolist(), strict=True):
                cell = table.setdefault(int(key), [0, 0])
                cell[0] += int(hit)
                cell[1] += 1

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")

    def summary(self) -> dict:
        def table(t: dict[int, list[int]]) -> list[float]:
            return [t[k][0] / t[k][1] for k in sorted(t)]

        out = {"accuracy": self.accuracy, "answers": self.total, "by_query": table(self.by_query)}
        if self.by_pair:
            out["by_pair"] = table(self.by_pair)
        return out


def score_batch(
    logits: torch.Tensor, docs: Sequence[np.ndarray], masks: Sequence[np.ndarray]
) -> list[np.ndarray]:
    """Per document, whether each masked token is the argmax of the logits one position earlier.

    `logits` [b, s, V] of inputs doc[:-1] (padded): position p - 1 predicts token p.
    """
    greedy = logits.argmax(-1).cpu().numpy()  # [b, s]
    out = []
    for row, (doc, mask) in enumerate(zip(docs, masks, strict=True)):
        answers = np.flatnonzero(mask[1:]) + 1  # answer token positions in the document (never 0)
        out.append(greedy[row, answers - 1] == doc[answers])
    return out


def evaluate_documents(
    model: torch.nn.Module,
    documents,
    max_documents: int | None,
    batch_size: int,
    vocab_size: int,
    mqar_vocab: int | None,
    attention: AttentionTally | None = None,
) -> Tally:
    """Accuracy of `model` on the first `max_documents` of a `MaskedDocuments` (all when None); with
    `attention`, the same forward passes also add their attention at the answers to it."""
    device = next(model.parameters()).device
    count = len(documents) if max_documents is None else min(max_documents, len(documents))
    tally = Tally()
    for start in range(0, count, batch_size):
        docs, masks = zip(
            *(documents.get(i) for i in range(start, min(count, start + batch_size))), strict=True
        )
        longest = max(len(d) for d in docs) - 1
        inputs = np.zeros((len(docs), longest), dtype=np.int64)
        for row, doc in enumerate(docs):
            if doc.max(initial=0) >= vocab_size:
                raise DiffmegError(
                    f"{documents.prefix} holds token id {int(doc.max())}, outside the model's vocabulary "
                    f"of {vocab_size}; evaluate with data made for this model"
                )
            inputs[row, : len(doc) - 1] = doc[:-1]
        ids = torch.from_numpy(inputs).to(device)
        positions = torch.arange(longest, device=device).unsqueeze(0).expand_as(ids)
        reading = nullcontext() if attention is None else attention.reading(model, docs, masks)
        with torch.no_grad(), reading:
            logits = model(input_ids=ids, position_ids=positions, attention_mask=None)  # [b, s, V]
        for doc, mask, hits in zip(docs, masks, score_batch(logits, docs, masks), strict=True):
            answers = np.flatnonzero(mask[1:]) + 1
            pairs = pair_indices(doc, answers, mqar_vocab) if mqar_vocab else None
            tally.add(hits, np.arange(len(answers)), pairs)
    return tally


@dataclass
class MQAREvalConfig(EvalConfig):
    data_prefixes: list[str] = field(default_factory=list)
    """Loss-masked datasets to score (each checkpoint on each)."""
    all_iterations: bool = False
    """Every saved iteration of each --load (accuracy over training), else --iteration or the latest."""
    max_documents: int | None = 512
    batch_size: int = 64
    output_dir: str = "mqar_eval"
    plot: bool = False
    """The attention analysis's figure (accuracy has none)."""
    attention: bool = False
    """Also the attention analysis (`diffmeg.eval.mqar_attention`) on the same documents: MQAR data only."""


def resolve_checkpoints(cfg: MQAREvalConfig) -> list:
    """`CheckpointInfo`s of every (load, iteration) to evaluate; every iteration of a load keeps the
    load's label."""
    infos = cfg.checkpoints.resolve()  # labels, one vocabulary, --iteration
    if not cfg.all_iterations:
        return infos
    if cfg.checkpoints.iterations:
        raise DiffmegError("give --iteration or --all-iterations, not both")
    expanded = []
    for info in infos:
        iterations = [] if info.hf else iteration_dirs(info.root)
        if not iterations:
            raise DiffmegError(
                f"--load {info.root} holds no saved iteration; train with --save (and --save-interval)"
            )
        for iteration in iterations:
            each = read_checkpoint_info(info.root, iteration)
            each.label = info.label
            expanded.append(each)
    return expanded


def run_mqar_eval(cfg: MQAREvalConfig, log: Log = stderr) -> dict:
    """Evaluate every (checkpoint, iteration) on every dataset; write the summary and CSV if asked."""
    if not cfg.data_prefixes:
        raise DiffmegError("give at least one --data-prefix")
    if (cfg.max_documents is not None and cfg.max_documents < 1) or cfg.batch_size < 1:
        raise DiffmegError("--max-documents and --batch-size must be >= 1")
    prefixes = [strip_ext(p) for p in cfg.data_prefixes]
    for prefix in prefixes:
        parse_data_path([prefix])  # both files present, with a hint for the usual slips
        if not has_loss_mask(prefix):
            raise DiffmegError(
                f"--data-prefix {prefix} has no loss mask ({loss_mask_prefix(prefix)}.bin/.idx): the answers "
                "to score are its masked tokens (tools/make_mqar_data.py writes one)"
            )
    infos = resolve_checkpoints(cfg)
    if cfg.output_dir:
        start_outputs(cfg.output_dir, plot=cfg.plot and cfg.attention)
    datasets = [(prefix, MaskedDocuments(prefix), read_mqar_metadata(prefix)) for prefix in prefixes]
    if cfg.attention:
        for prefix, _, meta in datasets:
            if meta is None:
                raise DiffmegError(
                    f"--attention reads MQAR data, and {prefix} has no {os.path.basename(prefix)}.mqar.json "
                    "(write it with tools/make_mqar_data.py)"
                )

    results, attention = [], []
    for info, model in loaded_models(infos, cfg.dtype, cfg.seed):
        for prefix, documents, meta in datasets:
            mqar_vocab = meta["setting"]["vocab_size"] if meta else None
            reads = AttentionTally() if cfg.attention else None
            tally = evaluate_documents(
                model, documents, cfg.max_documents, cfg.batch_size, info.vocab_size, mqar_vocab, reads
            )
            results.append(
                {
                    **info.identity(),
                    "data_prefix": prefix,
                    "setting": meta["name"] if meta else None,
                    **tally.summary(),
                }
            )
            log(f"{info.label} @ {info.iteration}: {os.path.basename(prefix)} accuracy {tally.accuracy:.4f}")
            if reads is not None:
                keys = ("label", "load", "iteration", "architecture", "data_prefix", "setting", "accuracy")
                attention.append({k: results[-1][k] for k in keys} | {"layers": reads.summary()})
    summary = {"max_documents": cfg.max_documents, "results": results}
    if cfg.attention:
        summary["attention"] = attention
    if cfg.output_dir:
        write_json(os.path.join(cfg.output_dir, SUMMARY_NAME), summary)
        columns = ("label", "iteration", "setting", "data_prefix", "accuracy")
        write_rows(os.path.join(cfg.output_dir, CSV_NAME), [{c: r[c] for c in columns} for r in results])
        if cfg.attention:
            write_attention(cfg.output_dir, attention, cfg.max_documents, cfg.plot)
    return summary
