"""Streaming activation statistics: the running top-k is exact and the histogram median within its bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffmeg.eval.activation_stats import RANKS, ActivationStatsConfig, StreamingMagnitudes, token_windows


def exact_lower_median(values: torch.Tensor) -> float:
    v = values.abs().double().flatten().sort().values
    return float(v[(v.numel() + 1) // 2 - 1])


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_streaming_top_k_and_median_match_brute_force(scale):
    gen = torch.Generator().manual_seed(int(scale * 1000))
    chunks = [torch.randn(n, generator=gen) * scale for n in (7, 500, 3, 1200, 64)]
    chunks[3][5] = 0.0  # exact zeros land in the underflow bin
    acc = StreamingMagnitudes()
    for c in chunks:
        acc.update(c)
    everything = torch.cat(chunks).abs().double()
    torch.testing.assert_close(acc.top, everything.topk(100).values, rtol=0, atol=0)
    assert [acc.top_value(r) for r in RANKS] == [float(everything.topk(r).values[-1]) for r in RANKS]
    exact = exact_lower_median(everything)
    assert abs(acc.median() - exact) / exact < acc.relative_median_error
    assert acc.count == everything.numel()


def test_fewer_values_than_k():
    acc = StreamingMagnitudes()
    acc.update(torch.tensor([3.0, -5.0]))
    assert acc.top_value(1) == 5.0 and acc.top_value(2) == 3.0 and np.isnan(acc.top_value(3))


def test_streaming_over_a_model_equals_brute_force_over_kept_activations(tiny_ckpts):
    """Two tiny models over two windows: stream vs keep-everything give the same top-k and median."""
    from diffmeg.eval.activation_stats import collect_stats
    from diffmeg.eval.capture import capture_attention, capture_layer_outputs
    from diffmeg.eval.common import CheckpointSet, forward, loaded_models

    infos = CheckpointSet([str(tiny_ckpts["diff"]), str(tiny_ckpts["transformer"])]).resolve()
    cfg = ActivationStatsConfig(CheckpointSet([]), tokens=80, seed=3)
    for info, model in loaded_models(infos):
        windows = list(token_windows(cfg, info.vocab_size, True, 48))
        assert [len(w) for w in windows] == [48, 32]
        stats = collect_stats(model, iter(windows))
        kept: dict[str, list[torch.Tensor]] = {"attention_logits": [], "hidden_states": []}
        records = []
        with (
            capture_attention(model, records.append),
            capture_layer_outputs(model, lambda i, h, kept=kept: kept["hidden_states"].append(h.flatten())),
        ):
            for w in windows:
                forward(model, w.tolist())
        for rec in records:
            for logits in rec.logits:
                kept["attention_logits"].append(logits[..., rec.keep].flatten())
        expected_kinds = {"attention_logits", "hidden_states"}
        if info.architecture == "DIFF":
            expected_kinds |= {"attention_logits_1", "attention_logits_2"}
            assert (
                stats["attention_logits_1"].count + stats["attention_logits_2"].count
                == stats["attention_logits"].count
            )
        assert set(stats) == expected_kinds
        for kind, values in kept.items():
            everything = torch.cat(values).abs().double()
            acc = stats[kind]
            assert acc.count == everything.numel()
            torch.testing.assert_close(acc.top, everything.topk(100).values, rtol=0, atol=0)
            exact = exact_lower_median(everything)
            assert abs(acc.median() - exact) / exact < acc.relative_median_error


def test_streaming_kurtosis_matches_brute_force():
    """Chunks of different sizes, means and spreads (one with an outlier): merged moments = all at once."""
    gen = torch.Generator().manual_seed(11)
    chunks = [
        torch.randn(n, generator=gen) * s + m for n, s, m in ((5, 1.0, 0.0), (400, 3.0, 2.0), (1, 1, -7))
    ]
    chunks.append(torch.cat([torch.randn(300, generator=gen), torch.tensor([40.0])]))
    acc = StreamingMagnitudes()
    for c in chunks:
        acc.update(c)
    x = torch.cat(chunks).double()
    c = x - x.mean()
    expected = float(x.numel() * (c**4).sum() / (c**2).sum() ** 2)
    assert acc.kurtosis() == pytest.approx(expected, rel=1e-12)
    assert acc.moments[1] == pytest.approx(float(x.mean()), rel=1e-12)
    constant = StreamingMagnitudes()
    constant.update(torch.full((4,), 2.0))
    assert np.isnan(constant.kurtosis()) and np.isnan(StreamingMagnitudes().kurtosis())


def test_per_document_windows_never_cross_a_document(tmp_path):
    from diffmeg.errors import DiffmegError
    from diffmeg.eval.common import CheckpointSet
    from tests.eval.helpers import write_indexed_dataset

    docs = [list(range(1, 6)), list(range(10, 19)), [30, 31, 32]]
    prefix = write_indexed_dataset(tmp_path / "docs", docs)

    def windows(tokens: int) -> list[list[int]]:
        cfg = ActivationStatsConfig(CheckpointSet([]), tokens=tokens, data_prefix=prefix, per_document=True)
        return [w.tolist() for w in token_windows(cfg, 64, False, 6)]

    assert windows(100) == [docs[0], docs[1][:6], docs[2]]  # each document's first 6 tokens at most
    assert windows(8) == [docs[0], docs[1][:3]]  # the budget ends inside the second document
    cfg = ActivationStatsConfig(CheckpointSet([]), tokens=10, data_prefix=prefix, per_document=True)
    with pytest.raises(DiffmegError, match="outside the checkpoint's vocabulary of 12"):
        list(token_windows(cfg, 12, False, 6))
