"""Where an MQAR model looks when it answers: attention mass on the queried pair vs the rest of the context
(the DIFF paper's "attention to answer" and "attention noise", on the toy task).

For every answer of a held-out document, the attention row read is the query key's position: the one
whose next-token prediction is the answer, as `diffmeg.eval.mqar` scores it. That row's keys fall into
* the **pair**: the first occurrence of the query key in the context and the value right after it
  (`diffmeg.data.mqar.query_key_positions`, the pair `pair_indices` counts);
* the **noise**: every other context token (the other pairs and the distractors);
* the query section seen so far (earlier queries and answers, the query key itself): neither; its mass
  is reported as `query`, so pair + noise + query is the whole row.

**Raw** masses come from the map that multiplies V: the Transformer's softmax A (rows sum to 1); DIFF V1's
A1 - lambda A2 (one lambda per layer; rows sum to 1 - lambda); DIFF V2's attn[2i] - lambda_t attn[2i+1]
per query-head pair i (lambda per head and token; rows sum to 1 - lambda_t). **Normalised** masses divide
every DIFF row by that sum, 1 - lambda, so that rows sum to 1 for all three and the masses say where the
attention goes on one scale; what a row's total does to the output is a separate matter (V1's head
RMSNorm removes it, V2's output projection sees it). Entries of a DIFF row can be negative, so its noise
can cancel to zero or below.

Per layer: masses summed over the answers, divided by their number, then averaged over heads (DIFF: its h
pairs; the Transformer: its 2h heads); ratio = pair / noise of those means (None when noise <= 0).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from diffmeg.data.mqar import query_key_positions
from diffmeg.errors import DiffmegError
from diffmeg.eval.capture import AttentionRecord, capture_attention, decoder_layers
from diffmeg.eval.common import write_json, write_rows
from diffmeg.eval.plotting import Curve, plot_curves

MASSES = ("pair", "noise", "query")
SCALES = ("normalised", "raw")
SUMMARY_NAME = "mqar_attention.json"
CSV_NAME = "mqar_attention.csv"
PLOT_NAME = "mqar_attention.png"
ROWS_NOTE = "the query key's position at every answer (its next-token prediction is the answer)"
NORMALISATION_NOTE = (
    "raw: the map that multiplies V (Transformer: softmax; DIFF V1: A1 - lambda A2, rows sum to 1 - lambda; "
    "DIFF V2: attn[2i] - lambda_t attn[2i+1], rows sum to 1 - lambda_t); normalised: DIFF rows divided "
    "by 1 - lambda (V2: per head and token), so every architecture's rows sum to 1"
)


@dataclass
class AnswerRows:
    """The attention rows one batch's answers are read from, one entry per answer: its document's row in
    the batch, the query position, the queried pair's key position (its value follows) and where the
    document's context ends (its query section starts)."""

    batch: torch.Tensor
    row: torch.Tensor
    pair: torch.Tensor
    context: torch.Tensor

    @classmethod
    def of_documents(cls, docs: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> AnswerRows:
        """From documents and their loss masks (a masked token p is an answer; its row is p - 1)."""
        columns: list[list[int]] = [[], [], [], []]
        for b, (doc, mask) in enumerate(zip(docs, masks, strict=True)):
            answers = np.flatnonzero(mask[1:]) + 1
            if not len(answers):
                continue
            context = int(answers[0]) - 1  # the first query key starts the query section
            firsts = query_key_positions(doc, answers)
            if (firsts + 1 >= context).any():
                raise DiffmegError(
                    "an answer's query key has no key-value pair in the context before the queries: the "
                    "attention analysis reads MQAR documents (tools/make_mqar_data.py)"
                )
            for pos, first in zip(answers.tolist(), firsts.tolist(), strict=True):
                for column, value in zip(columns, (b, pos - 1, first, context), strict=True):
                    column.append(value)
        return cls(*(torch.tensor(c, dtype=torch.long) for c in columns))

    def __len__(self) -> int:
        return len(self.row)


def normalised_map(record: AttentionRecord) -> torch.Tensor:
    """The effective map with rows summing to 1: DIFF's A1 - lambda A2 divided by 1 - lambda (a scalar
    per layer for V1, [b, h, sq, 1] per head and token for V2); the softmax map as it is."""
    if record.kind != "diff":
        return record.maps[0]
    total = 1 - torch.as_tensor(record.lam, dtype=record.maps[0].dtype, device=record.maps[0].device)
    if bool((total.abs() < 1e-6).any()):
        raise DiffmegError(
            f"layer {record.layer}: lambda is 1, so the differential map's rows sum to 0 and cannot be "
            "normalised; read its raw masses"
        )
    return record.effective_map / total


def _answer_lambda(record: AttentionRecord, rows: AnswerRows) -> float | None:
    """lambda summed over the answers' rows (mean over heads for V2), None for a softmax layer."""
    if record.lam is None:
        return None
    if isinstance(record.lam, float):
        return record.lam * len(rows)
    lam = record.lam[rows.batch, :, rows.row, 0].double()  # [b, h, sq, 1] -> [n, h]
    return float(lam.mean(-1).sum())


def ratio(pair: float, noise: float) -> float | None:
    """pair / noise, or None where the noise has cancelled to zero or below."""
    return pair / noise if noise > 0 else None


class AttentionTally:
    """Per layer, the pair / noise / query masses per head summed over answers, raw and normalised."""

    def __init__(self) -> None:
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.answers: dict[int, int] = {}
        self.lambdas: dict[int, float] = {}

    def add(self, record: AttentionRecord, rows: AnswerRows) -> None:
        """One layer's record of one batch: its rows at `rows`' answers."""
        if not len(rows):
            return
        sk = record.maps[0].shape[-1]
        device = record.maps[0].device
        keys = torch.arange(sk, device=device)
        pair_key = rows.pair.to(device)[:, None]
        pair = (keys == pair_key) | (keys == pair_key + 1)  # [n, sk]
        context = keys < rows.context.to(device)[:, None]
        sets = torch.stack([pair, context & ~pair, ~context & ~pair]).double()  # [3, n, sk]: MASSES
        batch, row = rows.batch.to(device), rows.row.to(device)
        sums = self.sums.setdefault(record.layer, {})
        for scale, full in (("raw", record.effective_map), ("normalised", normalised_map(record))):
            selected = full[batch, :, row, :].double()  # [b, h, sq, sk] -> [n, h, sk]
            masses = torch.einsum("nhk,mnk->mh", selected, sets).cpu()  # [3, h], summed over answers
            sums[scale] = sums[scale] + masses if scale in sums else masses
        self.answers[record.layer] = self.answers.get(record.layer, 0) + len(rows)
        lam = _answer_lambda(record, rows)
        if lam is not None:
            self.lambdas[record.layer] = self.lambdas.get(record.layer, 0.0) + lam

    @contextmanager
    def reading(
        self, model: torch.nn.Module, docs: Sequence[np.ndarray], masks: Sequence[np.ndarray]
    ) -> Iterator[None]:
        """Within the block, a forward pass of `model` over the batch `docs` (inputs doc[:-1]) adds its
        layers' records at the answers of `masks`; every layer must report (an attention path the capture
        does not cover would leave a layer out silently)."""
        rows = AnswerRows.of_documents(docs, masks)
        seen: list[int] = []

        def sink(record: AttentionRecord) -> None:
            seen.append(record.layer)
            self.add(record, rows)

        with capture_attention(model, sink):
            yield
        expected = len(decoder_layers(model))
        if sorted(set(seen)) != list(range(expected)):
            raise DiffmegError(
                f"attention maps came from layers {sorted(set(seen))} of {expected} (an attention path the "
                "capture does not cover)"
            )

    def summary(self) -> list[dict]:
        """One entry per layer: answers, mean lambda at the answers, and per scale the masses averaged
        over answers and heads, their ratio and the per-head values."""
        out = []
        for layer in sorted(self.sums):
            n = self.answers[layer]
            entry: dict = {"layer": layer, "answers": n}
            entry["lambda"] = self.lambdas[layer] / n if layer in self.lambdas else None
            for scale in SCALES:
                per_head = self.sums[layer][scale] / n  # [3, h]
                means = dict(zip(MASSES, per_head.mean(-1).tolist(), strict=True))
                entry[scale] = {
                    **means,
                    "ratio": ratio(means["pair"], means["noise"]),
                    "by_head": dict(zip(MASSES, per_head.tolist(), strict=True)),
                }
            out.append(entry)
        return out


def table_rows(results: Sequence[dict]) -> list[dict]:
    """Flat rows per (result, layer, scale) for the CSV: label, iteration, setting, layer, normalised,
    pair_mass, noise_mass, query_mass, ratio, lambda."""
    rows = []
    for r in results:
        for layer in r["layers"]:
            for scale in SCALES:
                m = layer[scale]
                rows.append(
                    {key: r[key] for key in ("label", "iteration", "setting")}
                    | {"layer": layer["layer"], "normalised": scale == "normalised"}
                    | {f"{mass}_mass": m[mass] for mass in MASSES}
                    | {"ratio": m["ratio"], "lambda": layer["lambda"]}
                )
    return rows


def plot(results: Sequence[dict], path: str) -> None:
    """Normalised pair and noise masses against the layer, one pair of curves per checkpoint and dataset
    (its last iteration when several were read)."""
    last: dict[tuple, dict] = {}
    for r in results:
        key = (r["label"], r["data_prefix"])
        if key not in last or r["iteration"] > last[key]["iteration"]:
            last[key] = r
    settings = {r["setting"] for r in last.values()}
    curves = []
    for r in last.values():
        name = r["label"] if len(settings) == 1 else f"{r['label']} ({r['setting']})"
        x = np.array([layer["layer"] for layer in r["layers"]])
        for mass in ("pair", "noise"):
            y = np.array([layer["normalised"][mass] for layer in r["layers"]])
            curves.append(Curve(f"{name}: {mass}", x, y))
    plot_curves(
        curves,
        path,
        xlabel="layer",
        ylabel="attention mass at the answers (normalised, mean over heads)",
        title="MQAR: attention on the queried pair vs the rest of the context",
    )


def write_attention(output_dir: str, results: list[dict], max_documents: int | None, with_plot: bool) -> None:
    """mqar_attention.json, .csv and (with `with_plot`) .png under `output_dir`."""
    summary = {
        "max_documents": max_documents,
        "rows": ROWS_NOTE,
        "normalisation": NORMALISATION_NOTE,
        "results": results,
    }
    write_json(os.path.join(output_dir, SUMMARY_NAME), summary)
    write_rows(os.path.join(output_dir, CSV_NAME), table_rows(results))
    if with_plot:
        plot(results, os.path.join(output_dir, PLOT_NAME))
