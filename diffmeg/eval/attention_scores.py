"""The paper's "attention to answer" and "attention noise": where a retrieving model's attention goes.

For a needle prompt, the query is the last prompt position (the one whose next-token prediction is
the first answer token). For each layer and head, the attention mass it puts on the queried needle's
number (the answer span) and on every other context token (filler and the rest of the needles: the
noise) is read from the explicit attention map; the question tokens count as neither.

For DIFF the map is the differential map A1 - lambda A2 itself, not renormalised: its rows sum to
1 - lambda, and entries may be negative (so "noise" can drop below zero where A2 outweighs A1).
This is the quantity that multiplies V, as in the paper. The Transformer's map is its softmax
(rows sum to 1). Masses are averaged over samples per depth.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from diffmeg.errors import DiffmegError, stderr
from diffmeg.eval import common
from diffmeg.eval.capture import AttentionRecord, capture_attention, decoder_layers
from diffmeg.eval.needle import build_prompt, needle_vocab
from diffmeg.eval.needle_eval import NeedlePromptsConfig
from diffmeg.eval.plotting import Curve, plot_curves

CSV_NAME = "attention_scores.csv"
PLOT_NAME = "attention_scores.png"
SUMMARY_NAME = "attention_scores.json"


def span_masses(
    map_rows: torch.Tensor, answer_spans: Sequence[tuple[int, int]], context_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(answer, noise) masses per head from query rows `map_rows` [h, sk].

    answer: the summed weights on the answer spans' keys; noise: on the other keys before
    `context_length` (keys after it, the question, are neither).
    """
    answer_keys = torch.zeros(map_rows.shape[-1], dtype=torch.bool, device=map_rows.device)
    for start, stop in answer_spans:
        answer_keys[start:stop] = True
    context_keys = torch.zeros_like(answer_keys)
    context_keys[:context_length] = True
    rows = map_rows.double()
    return rows[:, answer_keys].sum(-1), rows[:, context_keys & ~answer_keys].sum(-1)


def record_masses(
    record: AttentionRecord, answer_spans: Sequence[tuple[int, int]], context_length: int, query: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Answer/noise masses per head of one layer's record, from query position `query` (batch row 0)."""
    return span_masses(record.effective_map[0, :, query, :], answer_spans, context_length)


@dataclass
class AttentionScoresConfig(NeedlePromptsConfig):
    samples: int = 4
    length: int | None = None
    num_needles: int = 1
    num_queries: int = 1


def run_attention_scores(cfg: AttentionScoresConfig, log: common.Log = stderr) -> dict:
    """Masses per (checkpoint, depth, layer, head); writes the CSV, the JSON summary and the plot."""
    common.start_outputs(cfg.output_dir, cfg.plot)
    infos = cfg.checkpoints.resolve()
    length = cfg.length or min(i.seq_length for i in infos)
    vocab = needle_vocab(infos[0], cfg.text_files, cfg.tokenizer_file)
    prompts = {
        d: [
            build_prompt(vocab, length, d, cfg.num_needles, cfg.num_queries, seed=cfg.seed + 7919 * s)
            for s in range(cfg.samples)
        ]
        for d in cfg.depths
    }
    rows: list[dict] = []
    checkpoints = []
    for info, model in common.loaded_models(infos, cfg.dtype, cfg.seed):
        per_depth = {}
        lambdas: dict[int, list[float]] = {}
        for depth, batch in prompts.items():
            sums: dict[int, list[torch.Tensor]] = {}
            for prompt in batch:
                spans = [n.value_span for n in prompt.queried]
                seen: list[int] = []

                def on_record(
                    rec: AttentionRecord, spans=spans, prompt=prompt, seen=seen, sums=sums, lambdas=lambdas
                ) -> None:
                    # Reduced at once: a long prompt's full maps for every layer would not fit in memory.
                    answer, noise = record_masses(rec, spans, prompt.context_length)
                    acc = sums.setdefault(rec.layer, [torch.zeros_like(answer), torch.zeros_like(noise)])
                    acc[0] += answer
                    acc[1] += noise
                    seen.append(rec.layer)
                    if rec.mean_lambda is not None:
                        lambdas.setdefault(rec.layer, []).append(rec.mean_lambda)

                with capture_attention(model, on_record):
                    common.forward(model, prompt.tokens)
                if len(seen) != len(decoder_layers(model)):
                    raise DiffmegError(
                        f"{info.label}: attention maps came from {len(seen)} of {len(decoder_layers(model))} "
                        "layers (an attention path the capture does not cover)"
                    )
            answers, noises = [], []
            for layer, (a, n) in sorted(sums.items()):
                a, n = (a / len(batch)).tolist(), (n / len(batch)).tolist()
                answers.append(a)
                noises.append(n)
                for head, (ah, nh) in enumerate(zip(a, n, strict=True)):
                    rows.append(
                        {"label": info.label, "architecture": info.architecture, "depth": depth}
                        | {"layer": layer, "head": head}
                        | {"answer_mass": f"{ah:.6f}", "noise_mass": f"{nh:.6f}"}
                    )
            per_depth[depth] = {"answer": float(np.mean(answers)), "noise": float(np.mean(noises))}
        checkpoints.append(
            {
                **info.identity(),
                "by_depth": {str(d): v for d, v in per_depth.items()},
                "answer_mass": float(np.mean([v["answer"] for v in per_depth.values()])),
                "noise_mass": float(np.mean([v["noise"] for v in per_depth.values()])),
                "lambda_by_layer": {str(k): float(np.mean(v)) for k, v in sorted(lambdas.items())} or None,
            }
        )
        log(
            f"{info.label}: attention to answer {checkpoints[-1]['answer_mass']:.4f}, "
            f"noise {checkpoints[-1]['noise_mass']:.4f} (mean over layers, heads, depths)"
        )
    common.write_rows(os.path.join(cfg.output_dir, CSV_NAME), rows)
    summary = {
        "length": length,
        "depths": cfg.depths,
        "num_needles": cfg.num_needles,
        "num_queries": cfg.num_queries,
        "samples": cfg.samples,
        "seed": cfg.seed,
        "query_position": "last prompt token",
        "normalisation": "DIFF: A1 - lambda*A2 as is (rows sum to 1 - lambda); Transformer: softmax",
        "checkpoints": checkpoints,
    }
    common.write_json(os.path.join(cfg.output_dir, SUMMARY_NAME), summary)
    if cfg.plot:
        _plot(checkpoints, cfg, length)
    return summary


def _plot(checkpoints: list[dict], cfg: AttentionScoresConfig, length: int) -> None:
    x = np.asarray(cfg.depths, dtype=np.float64) * 100
    curves = []
    for ckpt in checkpoints:
        for key in ("answer", "noise"):
            y = np.array([ckpt["by_depth"][str(d)][key] for d in cfg.depths])
            curves.append(Curve(f"{ckpt['label']}: {key}", x, y))
    plot_curves(
        curves,
        os.path.join(cfg.output_dir, PLOT_NAME),
        xlabel="depth of the queried needle (%)",
        ylabel="attention mass (mean over layers and heads)",
        title=f"Attention to answer vs noise, {length} tokens, N={cfg.num_needles}, R={cfg.num_queries}",
    )
