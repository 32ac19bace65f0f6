"""The paper's activation-outlier table: top-1/2/3/10/100 and median magnitudes of attention logits
and hidden states, streamed over a token budget without keeping the activations.

Per tensor kind, `StreamingMagnitudes` keeps
* the exact k largest magnitudes seen (a running top-k: each batch's own top-k merged with the kept
  ones, so the result equals the top-k of all values), and
* a fixed-bin histogram of log10 magnitudes for the median. The exact median needs every value; the
  histogram has `bins_per_decade` bins per factor of ten over [1e-8, 1e8], and the median is read by
  geometric interpolation inside its bin, so its relative error is below 10**(1/bins_per_decade) - 1
  (2.9% at the default 80) for medians inside that range. Magnitudes below 1e-8 (exact zeros
  included) count in an underflow bin read as 0; above 1e8, in an overflow bin read as 1e8.
* the count, mean and central moments of the signed values, merged batch by batch with Pebay's
  pairwise formulas (exact up to float64 rounding), for the kurtosis E[(x - mean)^4] / Var(x)^2
  (Pearson's: 3 for a Gaussian; heavy tails, i.e. outliers, make it large).

Kinds: `attention_logits` (the scaled pre-softmax q.k/sqrt(d), causally visible entries only; for
DIFF both maps together), for DIFF also `attention_logits_1` / `attention_logits_2` (each map), and
`hidden_states` (every decoder layer's output). With `per_document`, every window is one document's
first tokens (e.g. an MQAR document as the model trained on it), never a window across two documents.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from diffmeg.errors import DiffmegError, stderr
from diffmeg.eval import common
from diffmeg.eval.capture import AttentionRecord, capture_attention, capture_layer_outputs
from diffmeg.eval.long_context import IndexedDocuments
from diffmeg.eval.plotting import Curve, plot_curves

CSV_NAME = "activation_stats.csv"
PLOT_NAME = "activation_stats.png"
SUMMARY_NAME = "activation_stats.json"
RANKS = (1, 2, 3, 10, 100)
LOG10_LOW, LOG10_HIGH = -8.0, 8.0


class StreamingMagnitudes:
    """Exact running top-k and histogram median of |values|, fed one tensor at a time."""

    def __init__(self, k: int = max(RANKS), bins_per_decade: int = 80) -> None:
        self.k = k
        self.bins_per_decade = bins_per_decade
        self.top = torch.empty(0, dtype=torch.float64)
        nbins = int((LOG10_HIGH - LOG10_LOW) * bins_per_decade)
        self.hist = torch.zeros(nbins + 2, dtype=torch.int64)  # [underflow, bins..., overflow]
        self.count = 0
        self.moments = (0, 0.0, 0.0, 0.0, 0.0)  # signed values: n, mean, M2, M3, M4 (M_k = sum (x - mean)^k)

    @property
    def relative_median_error(self) -> float:
        """Bound on |estimate - exact| / exact for a median within [1e-8, 1e8]."""
        return 10 ** (1 / self.bins_per_decade) - 1

    def update(self, values: torch.Tensor) -> None:
        signed = values.detach().flatten().double().cpu()
        mags = signed.abs()
        if mags.numel() == 0:
            return
        if torch.isnan(mags).any():
            raise DiffmegError("NaN in the activations: the checkpoint or --dtype gives non-finite values")
        self.count += mags.numel()
        centred = signed - signed.mean()
        batch = (signed.numel(), float(signed.mean()), *(float((centred**k).sum()) for k in (2, 3, 4)))
        self.moments = merge_moments(self.moments, batch)
        batch_top = torch.topk(mags, min(self.k, mags.numel())).values
        merged = torch.cat([self.top, batch_top])
        self.top = torch.topk(merged, min(self.k, merged.numel())).values
        nbins = self.hist.numel() - 2
        idx = torch.floor((torch.log10(mags) - LOG10_LOW) * self.bins_per_decade)  # -inf for zeros
        idx = torch.where(mags < 10**LOG10_LOW, torch.full_like(idx, -1), idx)
        idx = idx.clamp(-1, nbins).long() + 1
        self.hist += torch.bincount(idx, minlength=self.hist.numel())

    def kurtosis(self) -> float:
        """Pearson's kurtosis of the signed values (n M4 / M2^2), NaN when they do not vary."""
        n, _, m2, _, m4 = self.moments
        return n * m4 / m2**2 if n and m2 > 0 else math.nan

    def top_value(self, rank: int) -> float:
        """The rank-th largest magnitude (1-based), NaN when fewer values were seen."""
        return float(self.top[rank - 1]) if rank <= self.top.numel() else math.nan

    def median(self) -> float:
        """The lower median (value of rank ceil(n/2) in ascending order), from the histogram."""
        if self.count == 0:
            return math.nan
        target = (self.count + 1) // 2
        cum = torch.cumsum(self.hist, 0)
        b = int(torch.searchsorted(cum, torch.tensor(target)).item())
        if b == 0:
            return 0.0
        if b == self.hist.numel() - 1:
            return 10**LOG10_HIGH
        before = int(cum[b - 1])
        frac = (target - before - 0.5) / int(self.hist[b])
        return 10 ** (LOG10_LOW + (b - 1 + frac) / self.bins_per_decade)


def merge_moments(a: tuple, b: tuple) -> tuple:
    """(n, mean, M2, M3, M4) of two sets of values together, from each set's own (Pebay 2008, eqs. 2.1,
    2.3, 2.4 for two parts), M_k the sum of (x - mean)^k."""
    na, ma, m2a, m3a, m4a = a
    nb, mb, m2b, m3b, m4b = b
    if na == 0 or nb == 0:
        return b if na == 0 else a
    n = na + nb
    d = mb - ma
    m2 = m2a + m2b + d**2 * na * nb / n
    m3 = m3a + m3b + d**3 * na * nb * (na - nb) / n**2 + 3 * d * (na * m2b - nb * m2a) / n
    m4 = (
        m4a
        + m4b
        + d**4 * na * nb * (na**2 - na * nb + nb**2) / n**3
        + 6 * d**2 * (na**2 * m2b + nb**2 * m2a) / n**2
        + 4 * d * (na * m3b - nb * m3a) / n
    )
    return n, ma + d * nb / n, m2, m3, m4


@dataclass
class ActivationStatsConfig(common.EvalConfig):
    tokens: int = 409_600
    seq_length: int | None = None
    data_prefix: str | None = None
    per_document: bool = False
    """One window per document (its first seq_length tokens) instead of windows across documents."""


def token_windows(
    cfg: ActivationStatsConfig, vocab_size: int, mock: bool, length: int
) -> Iterator[np.ndarray]:
    """Windows of `length` ids up to the token budget: from --data-prefix documents (concatenated in
    order), else seeded random ids (mock-vocabulary checkpoints only)."""
    remaining = cfg.tokens
    if cfg.data_prefix is None:
        if not mock:
            raise DiffmegError("give --data-prefix (random ids only make sense for mock-data checkpoints)")
        rng = np.random.default_rng(cfg.seed)
        while remaining > 0:
            n = min(length, remaining)
            yield rng.integers(0, vocab_size, n)
            remaining -= n
        return

    source = IndexedDocuments(cfg.data_prefix)
    buffer = np.zeros(0, dtype=np.int64)  # the documents not yet cut into windows (not per document)
    for doc in range(len(source.lengths)):
        if remaining <= 0:
            return
        size = int(source.lengths[doc])
        tokens = source.read(doc, min(length, size, remaining) if cfg.per_document else size)
        if tokens.max(initial=0) >= vocab_size:
            raise DiffmegError(
                f"document {doc} of {source.description} holds token id {int(tokens.max())}, outside "
                f"the checkpoint's vocabulary of {vocab_size}"
            )
        if cfg.per_document:
            remaining -= len(tokens)
            yield tokens
            continue
        buffer = np.concatenate([buffer, tokens])
        while remaining > 0 and len(buffer) >= min(length, remaining):
            n = min(length, remaining)
            window, buffer = buffer[:n], buffer[n:]
            remaining -= n
            yield window
    if remaining > 0 and len(buffer):
        yield buffer[:remaining]


def collect_stats(model: torch.nn.Module, windows: Iterator[np.ndarray]) -> dict[str, StreamingMagnitudes]:
    """Stream every window through the model, feeding logits and layer outputs to the accumulators."""
    stats: dict[str, StreamingMagnitudes] = {}

    def add(kind: str, values: torch.Tensor) -> None:
        stats.setdefault(kind, StreamingMagnitudes()).update(values)

    def on_attention(rec: AttentionRecord) -> None:
        for i, logits in enumerate(rec.logits):
            visible = logits[..., rec.keep]  # [b, h, n_visible]
            add("attention_logits", visible)
            if rec.kind == "diff":
                add(f"attention_logits_{i + 1}", visible)

    with (
        capture_attention(model, on_attention),
        capture_layer_outputs(model, lambda i, h: add("hidden_states", h)),
    ):
        for window in windows:
            common.forward(model, window.tolist())
    return stats


def run_activation_stats(cfg: ActivationStatsConfig, log: common.Log = stderr) -> dict:
    if cfg.tokens < 1:
        raise DiffmegError(f"--tokens must be >= 1, got {cfg.tokens}")
    if cfg.per_document and cfg.data_prefix is None:
        raise DiffmegError("--per-document reads the documents of --data-prefix; give one")
    common.start_outputs(cfg.output_dir, cfg.plot)
    infos = cfg.checkpoints.resolve()
    length = cfg.seq_length or min(i.seq_length for i in infos)
    if cfg.data_prefix is not None:  # the first window checks the data before any model loads
        next(token_windows(cfg, infos[0].vocab_size, infos[0].tokenizer == "mock", length), None)
    rows, checkpoints = [], []
    for info, model in common.loaded_models(infos, cfg.dtype, cfg.seed):
        windows = token_windows(cfg, info.vocab_size, info.tokenizer == "mock", length)
        stats = collect_stats(model, windows)
        kinds = {}
        for kind, acc in sorted(stats.items()):
            kinds[kind] = {f"top{r}": acc.top_value(r) for r in RANKS}
            kinds[kind] |= {"median": acc.median(), "kurtosis": acc.kurtosis(), "count": acc.count}
            rows.append({"label": info.label, "architecture": info.architecture, "kind": kind} | kinds[kind])
        checkpoints.append({**info.identity(), "stats": kinds})
        log(
            f"{info.label}: logits top1 {kinds['attention_logits']['top1']:.3f} median "
            f"{kinds['attention_logits']['median']:.3f}; hidden top1 {kinds['hidden_states']['top1']:.3f} "
            f"median {kinds['hidden_states']['median']:.3f}"
        )
    common.write_rows(os.path.join(cfg.output_dir, CSV_NAME), rows)
    summary = {
        "tokens": cfg.tokens,
        "seq_length": length,
        "data": cfg.data_prefix or f"random ids (seed {cfg.seed})",
        "per_document": cfg.per_document,
        "median": "log-histogram estimate, relative error < "
        f"{StreamingMagnitudes().relative_median_error:.4f}",
        "checkpoints": checkpoints,
    }
    common.write_json(os.path.join(cfg.output_dir, SUMMARY_NAME), summary)
    if cfg.plot:
        x = np.array(RANKS)
        curves = [
            Curve(f"{c['label']}: {kind}", x, np.array([c["stats"][kind][f"top{r}"] for r in RANKS]))
            for c in checkpoints
            for kind in ("attention_logits", "hidden_states")
        ]
        path, title = os.path.join(cfg.output_dir, PLOT_NAME), f"Activation outliers over {cfg.tokens} tokens"
        plot_curves(curves, path, xlabel="rank (top-k)", ylabel="magnitude", title=title, logx=True)
    return summary
