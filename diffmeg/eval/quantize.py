"""Robustness to low-bit attention logits (the DIFF paper's quantization experiment).

Dynamic post-training absmax quantization, applied inside attention to the scaled pre-softmax logits
(both maps for DIFF): per forward pass, per sequence and per head, scale = max|logit| over the
causally visible entries / (2^(bits-1) - 1); each logit becomes round(logit / scale) * scale,
clamped to +-(2^(bits-1) - 1) steps. 16 bits means no quantization: the model runs untouched, so its
numbers are exactly the unquantized ones. Then, per bit width, the validation loss (mean token NLL,
megatron-core's cross entropy through `per_token_nll`) and zero-shot multiple-choice accuracy:
each choice is scored by the summed log-likelihood of its tokens after the context (acc), and by
that sum per token (acc_norm); the highest wins.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from diffmeg.data.tokenizers import text_tokenizer
from diffmeg.errors import DiffmegError, stderr
from diffmeg.eval import common
from diffmeg.eval.activation_stats import ActivationStatsConfig, token_windows
from diffmeg.eval.capture import LogitFn, capture_attention
from diffmeg.eval.long_context import per_token_nll
from diffmeg.eval.plotting import Curve, plot_curves

CSV_NAME = "quantize_eval.csv"
PLOT_NAME = "quantize_eval.png"
SUMMARY_NAME = "quantize_eval.json"
NO_QUANTIZATION = 16


def absmax_quantizer(bits: int) -> LogitFn:
    """The logit transform for `bits`-bit symmetric absmax quantization (see the module docstring)."""
    if not 2 <= bits <= 15:
        raise DiffmegError(f"bit widths must be 2..15, or 16 for no quantization; got {bits}")
    qmax = 2 ** (bits - 1) - 1

    def quantize(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        visible = logits.masked_fill(~keep, 0.0).abs()
        scale = visible.amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(logits.dtype).tiny) / qmax
        return torch.round(logits / scale).clamp(-qmax, qmax) * scale

    return quantize


def quantized(model: torch.nn.Module, bits: int):
    """A context in which `model`'s attention logits are quantized to `bits` (16: untouched)."""
    if bits == NO_QUANTIZATION:
        return nullcontext()
    return capture_attention(model, None, absmax_quantizer(bits))


@dataclass
class Choice:
    context: list[int]
    choices: list[list[int]]
    label: int


def read_choices(path: str, vocab_size: int, tokenizer) -> list[Choice]:
    """Multiple-choice items from JSONL: {"context", "choices", "label"} as text (tokenized) or
    {"context_ids", "choices_ids", "label"} as token ids (mock-vocabulary checkpoints)."""
    items = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as exc:
        raise DiffmegError(f"cannot read --choices {path}: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "context_ids" in row:
                context = list(map(int, row["context_ids"]))
                choices = [list(map(int, c)) for c in row["choices_ids"]]
            else:
                if tokenizer is None:
                    raise DiffmegError(
                        f"{path}:{n}: text items need a cl100k checkpoint; give context_ids/choices_ids"
                    )
                context = tokenizer.tokenize(row["context"])
                choices = [tokenizer.tokenize(c) for c in row["choices"]]
            label = int(row["label"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DiffmegError(
                f"{path}:{n}: expected context/choices/label (or *_ids), got {exc!r}"
            ) from None
        if not context or len(choices) < 2 or not all(choices) or not 0 <= label < len(choices):
            raise DiffmegError(
                f"{path}:{n}: needs a non-empty context, >= 2 non-empty choices and a valid label"
            )
        if max(max(context), *(max(c) for c in choices)) >= vocab_size:
            raise DiffmegError(f"{path}:{n}: token id outside the checkpoint's vocabulary of {vocab_size}")
        items.append(Choice(context, choices, label))
    if not items:
        raise DiffmegError(f"--choices {path} holds no items")
    return items


def choice_scores(model: torch.nn.Module, item: Choice) -> list[tuple[float, int]]:
    """(log-likelihood of each choice's tokens after the context, its token count)."""
    device = next(model.parameters()).device
    out = []
    for choice in item.choices:
        tokens = torch.tensor([item.context + choice], device=device)
        nll = per_token_nll(model, tokens, chunk_size=None)[0]  # position p predicts token p + 1
        c = len(item.context)
        out.append((-float(nll[c - 1 : c - 1 + len(choice)].sum()), len(choice)))
    return out


def validation_loss(model: torch.nn.Module, windows: list[np.ndarray]) -> float:
    """Mean NLL per predicted token over the windows (each window predicts its tokens 1..n-1)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for w in windows:
        nll = per_token_nll(model, torch.as_tensor(w, device=device).unsqueeze(0), chunk_size=None)
        total += float(nll.double().sum())
        count += nll.numel()
    return total / count


@dataclass
class QuantizeEvalConfig(common.EvalConfig):
    bits: list[int] = field(default_factory=lambda: [16, 8, 6, 4])
    choices: str | None = None
    data_prefix: str | None = None
    tokens: int = 65_536
    seq_length: int | None = None
    tokenizer_file: str | None = None


def _windows(cfg: QuantizeEvalConfig, vocab_size: int, mock: bool, length: int) -> Iterator[np.ndarray]:
    # One more token per window than positions scored: the window's first token has no prediction.
    acfg = ActivationStatsConfig(
        common.CheckpointSet([]), tokens=cfg.tokens, data_prefix=cfg.data_prefix, seed=cfg.seed
    )
    return (w for w in token_windows(acfg, vocab_size, mock, length + 1) if len(w) > 1)


def run_quantize_eval(cfg: QuantizeEvalConfig, log: common.Log = stderr) -> dict:
    for b in cfg.bits:
        if b != NO_QUANTIZATION:
            absmax_quantizer(b)
    if cfg.tokens < 2:
        raise DiffmegError(f"--tokens must be >= 2, got {cfg.tokens}")
    common.start_outputs(cfg.output_dir, cfg.plot)
    infos = cfg.checkpoints.resolve()
    length = cfg.seq_length or min(i.seq_length for i in infos)
    mock = infos[0].tokenizer == "mock"
    tokenizer = None
    if cfg.choices and not mock:
        tokenizer = text_tokenizer(infos[0].args, cfg.tokenizer_file)
    items = read_choices(cfg.choices, infos[0].vocab_size, tokenizer) if cfg.choices else []
    windows = list(_windows(cfg, infos[0].vocab_size, mock, length))
    rows, checkpoints = [], []
    for info, model in common.loaded_models(infos, cfg.dtype, cfg.seed):
        results = {}
        for bits in cfg.bits:
            with quantized(model, bits):
                loss = validation_loss(model, windows)
                correct = correct_norm = 0
                for item in items:
                    scores = choice_scores(model, item)
                    correct += int(np.argmax([s for s, _ in scores]) == item.label)
                    correct_norm += int(np.argmax([s / n for s, n in scores]) == item.label)
            acc = correct / len(items) if items else math.nan
            acc_norm = correct_norm / len(items) if items else math.nan
            results[str(bits)] = {"val_loss": loss, "acc": acc, "acc_norm": acc_norm}
            rows.append(
                {"label": info.label, "architecture": info.architecture, "bits": bits}
                | {k: f"{v:.6f}" for k, v in results[str(bits)].items()}
            )
            log(f"{info.label} @ {bits} bits: loss {loss:.4f}, acc {acc:.4f}, acc_norm {acc_norm:.4f}")
        checkpoints.append({**info.identity(), "bits": results})
    common.write_rows(os.path.join(cfg.output_dir, CSV_NAME), rows)
    summary = {
        "bits": cfg.bits,
        "quantization": "dynamic absmax per sequence and head over visible logits; 16 = none",
        "validation_tokens": int(sum(len(w) - 1 for w in windows)),
        "data": cfg.data_prefix or f"random ids (seed {cfg.seed})",
        "choices": cfg.choices,
        "items": len(items),
        "checkpoints": checkpoints,
    }
    common.write_json(os.path.join(cfg.output_dir, SUMMARY_NAME), summary)
    if cfg.plot:
        metric = "acc" if items else "val_loss"
        x = np.array(cfg.bits, dtype=np.float64)
        order = np.argsort(x)
        curves = [
            Curve(c["label"], x[order], np.array([c["bits"][str(b)][metric] for b in cfg.bits])[order])
            for c in checkpoints
        ]
        plot_curves(
            curves,
            os.path.join(cfg.output_dir, PLOT_NAME),
            xlabel="attention logit bits (16 = not quantized)",
            ylabel="multiple-choice accuracy" if items else "validation loss",
            title="Low-bit attention logits",
        )
    return summary
