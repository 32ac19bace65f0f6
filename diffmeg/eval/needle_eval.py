"""Multi-needle retrieval accuracy (LWM / Gemini 1.5 protocol, as in the DIFF paper).

Each prompt holds N needles (city -> magic number) in filler and asks for R of them (see
`diffmeg.eval.needle`). Scoring is greedy decoding by teacher forcing: one forward pass over
prompt + answer gives, at every answer position, the model's greedy next token given the correct
answer so far; a queried number counts as retrieved when every one of its tokens is the greedy
choice. For R = 1 this is exactly "greedy generation reproduces the number"; for R > 1 each number is
judged given the correct earlier numbers (greedy generation would instead carry an earlier mistake
forward). A prompt scores the fraction of its R numbers retrieved; accuracy is the mean over samples.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from diffmeg.errors import DiffmegError, stderr
from diffmeg.eval import common
from diffmeg.eval.needle import NeedlePrompt, build_prompt, needle_vocab
from diffmeg.eval.plotting import plot_heatmaps

CSV_NAME = "needle_accuracy.csv"
PLOT_NAME = "needle_heatmap.png"
SUMMARY_NAME = "needle_summary.json"


def score_prompt(logits_fn: Callable[[Sequence[int]], torch.Tensor], prompt: NeedlePrompt) -> list[bool]:
    """Per queried number, whether greedy decoding retrieves it (`logits_fn(tokens)` -> [s, V])."""
    tokens = prompt.tokens.tolist() + prompt.answer[:-1]
    logits = logits_fn(tokens)
    start = len(prompt.tokens) - 1  # this position predicts the first answer token
    greedy = logits[start : start + len(prompt.answer)].argmax(-1).tolist()
    return [greedy[a:b] == prompt.answer[a:b] for a, b in prompt.answer_parts]


@dataclass
class NeedlePromptsConfig(common.EvalConfig):
    """What the tools reading needle prompts share (this one and `diffmeg.eval.attention_scores`)."""

    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Where the first queried needle sits: 0 = the start of the context, 1 = its end."""
    samples: int = 10
    """Prompts per setting, from seeds `seed + 7919 * k`."""
    text_files: list[str] | None = None
    """Filler text (cl100k checkpoints; mock-vocabulary ones get random ids)."""
    tokenizer_file: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive("samples")
        if not self.depths:
            raise DiffmegError("give at least one --depths value")


@dataclass
class NeedleEvalConfig(NeedlePromptsConfig):
    lengths: list[int] | None = None
    needles: list[int] = field(default_factory=lambda: [1, 2, 4, 6])
    queries: list[int] = field(default_factory=lambda: [1, 2])
    heatmap_needles: int | None = None


def run_needle_eval(cfg: NeedleEvalConfig, log: common.Log = stderr) -> dict:
    """Accuracy per (checkpoint, N, R, length, depth); the CSV, a summary table and the heatmap."""
    combos = [(n, r) for n in cfg.needles for r in cfg.queries if r <= n]
    if not combos:
        raise DiffmegError("no (needles, queries) pair with queries <= needles")
    heat_n = cfg.heatmap_needles or max(cfg.needles)
    if (cfg.plot or cfg.heatmap_needles is not None) and (heat_n, 1) not in combos:
        combos.append((heat_n, 1))  # the heatmap's R = 1, measured though --queries leaves 1 out
    common.start_outputs(cfg.output_dir, cfg.plot)
    infos = cfg.checkpoints.resolve()
    lengths = cfg.lengths or [min(i.seq_length for i in infos)]
    vocab = needle_vocab(infos[0], cfg.text_files, cfg.tokenizer_file)
    grid = [(n, r, length, d) for n, r in combos for length in lengths for d in cfg.depths]
    prompts = {
        key: [
            build_prompt(vocab, key[2], key[3], key[0], key[1], seed=cfg.seed + 7919 * s)
            for s in range(cfg.samples)
        ]
        for key in grid
    }
    rows, checkpoints, grids = [], [], []
    for info, model in common.loaded_models(infos, cfg.dtype, cfg.seed):
        for length in lengths:
            if length > info.seq_length:
                log(f"warning: {length} tokens exceeds {info.label}'s training length {info.seq_length}")
        acc = {}
        for key, batch in prompts.items():
            scores = [np.mean(score_prompt(lambda t, m=model: common.forward(m, t), p)) for p in batch]
            acc[key] = float(np.mean(scores))
            n, r, length, depth = key
            rows.append(
                {"label": info.label, "architecture": info.architecture, "needles": n, "queries": r}
                | {"length": length, "depth": depth, "accuracy": f"{acc[key]:.4f}", "samples": len(batch)}
            )
        table = {
            f"N={n},R={r}": float(np.mean([v for k, v in acc.items() if k[:2] == (n, r)])) for n, r in combos
        }
        checkpoints.append({**info.identity(), "table": table})
        if cfg.plot:  # the heatmap: N = heat_n, R = 1
            grid = [[acc[(heat_n, 1, L, d)] for L in lengths] for d in cfg.depths]  # [depths, lengths]
            grids.append((info.label, np.array(grid)))
        log(f"{info.label}: " + ", ".join(f"{k} {v:.3f}" for k, v in table.items()))
    common.write_rows(os.path.join(cfg.output_dir, CSV_NAME), rows)
    summary = {
        "lengths": lengths,
        "depths": cfg.depths,
        "samples": cfg.samples,
        "seed": cfg.seed,
        "scoring": "teacher-forced greedy: a number counts when all its tokens are the greedy choice",
        "heatmap": {"needles": heat_n, "queries": 1},
        "checkpoints": checkpoints,
    }
    common.write_json(os.path.join(cfg.output_dir, SUMMARY_NAME), summary)
    if cfg.plot:
        plot_heatmaps(
            grids,
            os.path.join(cfg.output_dir, PLOT_NAME),
            xticks=[str(L) for L in lengths],
            yticks=[f"{round(d * 100)}%" for d in cfg.depths],
            xlabel="context length (tokens)",
            ylabel="needle depth",
            title=f"Multi-needle retrieval accuracy, N={heat_n}, R=1",
        )
    return summary
