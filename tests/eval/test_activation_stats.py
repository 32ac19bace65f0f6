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
