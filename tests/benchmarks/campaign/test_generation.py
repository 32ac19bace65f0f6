"""benchmarks/campaign/generation.py: KV-cache greedy tokens against recomputation, near-ties allowed."""

from __future__ import annotations

import torch

from benchmarks.campaign.generation import generation_check, greedy_agreement
from tests.conversion.helpers import trained_tiny


def _logits(steps: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(steps, vocab, generator=torch.Generator().manual_seed(seed)) * 3  # [T, V]


def test_a_near_tie_may_flip_a_decisive_position_may_not():
    reference = _logits()
    reference[2, 7], reference[2, 8] = 20.0, 20.0 - 1e-3  # position 2: a near-tie, within bf16 rounding
    recomputed = reference.bfloat16()  # the run's dtype: its error against float32 sets the tolerance
    cached = reference.argmax(dim=-1).tolist()
    result = greedy_agreement(cached, recomputed, reference)
    assert result["ok"] and result["positions"] == 6 and result["decisive"] == 5
    assert 0 < result["bf16_error"] < result["tolerance"] < 1.0

    flipped = list(cached)
    flipped[2] = 8  # the runner-up of the near-tie: bf16 may pick it
    assert greedy_agreement(flipped, recomputed, reference)["ok"]

    wrong = list(cached)
    wrong[4] = int(reference[4].argsort()[-2])  # the runner-up where the margin is decisive
    result = greedy_agreement(wrong, recomputed, reference)
    assert not result["ok"] and result["mismatches"] == [4]


def test_float32_runs_compare_every_position():
    """On a CPU (float32 run) the tolerance is float32's rounding: every clear position is compared."""
    reference = _logits(seed=1)
    result = greedy_agreement(reference.argmax(dim=-1).tolist(), reference.clone(), reference)
    assert result["ok"] and result["decisive"] == result["positions"] and result["bf16_error"] == 0.0


def test_the_check_passes_on_a_trained_checkpoint(tmp_path_factory, single_rank_parallel_state):
    """The memory phase's check end to end on a CPU (it rotted once behind a moved import)."""
    result = generation_check(trained_tiny(tmp_path_factory, "tp1"), "cpu", 6)
    assert result["error"] is None and result["ok"], result
    assert result["cache_agrees_with_recompute"] and result["seeded_sampling_repeats"]
