"""Answer/noise masses from constructed attention maps, and that DIFF's differential map is the one used."""

from __future__ import annotations

import pytest
import torch

from diffmeg.eval.attention_scores import record_masses, span_masses
from diffmeg.eval.capture import AttentionRecord, _diff_backend
from diffmeg.kernels.reference import causal_keep_mask, diff_attention_reference


def test_masses_of_a_constructed_map_are_the_hand_computed_sums():
    # One query row over 6 keys: context is keys 0..3 (answer = keys 1..2), keys 4..5 are the question.
    row = torch.tensor([[0.10, 0.25, 0.15, 0.05, 0.30, 0.15], [0.0, 0.5, 0.5, 0.0, 0.0, 0.0]])
    answer, noise = span_masses(row, [(1, 3)], context_length=4)
    assert answer.tolist() == pytest.approx([0.40, 1.0])
    assert noise.tolist() == pytest.approx([0.15, 0.0])
    # Two answer spans (R=2) both count as answer.
    answer, noise = span_masses(row, [(0, 1), (3, 4)], context_length=4)
    assert answer.tolist() == pytest.approx([0.15, 0.0]) and noise.tolist() == pytest.approx([0.40, 1.0])


def test_diff_masses_use_a1_minus_lambda_a2_not_a1():
    keep = causal_keep_mask(3, 3, torch.device("cpu"))
    a1 = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0.2, 0.6, 0.2]]).view(1, 1, 3, 3)
    a2 = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0.6, 0.2, 0.2]]).view(1, 1, 3, 3)
    rec = AttentionRecord(0, "diff", [a1, a2], [a1, a2], keep, lam=0.5)
    answer, noise = record_masses(rec, [(1, 2)], context_length=2)
    # last row: A1 - 0.5 A2 = [0.2 - 0.3, 0.6 - 0.1, 0.2 - 0.1] = [-0.1, 0.5, 0.1]
    assert answer.item() == pytest.approx(0.5) and noise.item() == pytest.approx(-0.1)
    assert rec.effective_map[0, 0, 2].sum().item() == pytest.approx(1 - 0.5)  # rows sum to 1 - lambda
    a1_only = span_masses(a1[0, :, 2], [(1, 2)], 2)
    assert a1_only[0].item() == pytest.approx(0.6)  # what A1 alone would have said


def test_capture_backend_reports_the_maps_the_output_is_made_of():
    """The capturing backend returns what the reference backend returns, from the maps it reports."""
    gen = torch.Generator().manual_seed(0)
    b, h, g, s, d = 1, 4, 2, 7, 8
    q1, q2 = (torch.randn(b, h, s, d, generator=gen) for _ in range(2))
    k1, k2 = (torch.randn(b, g, s, d, generator=gen) for _ in range(2))
    v = torch.randn(b, g, s, 2 * d, generator=gen)
    lam = torch.tensor(0.3)
    records: list[AttentionRecord] = []
    out = _diff_backend(0, records.append, None)(q1, q2, k1, k2, v, lam, scale=d**-0.5)
    ref = diff_attention_reference(q1, q2, k1, k2, v, lam, scale=d**-0.5)
    torch.testing.assert_close(out, ref)
    (rec,) = records
    assert rec.kind == "diff" and rec.lam == pytest.approx(0.3)
    torch.testing.assert_close(rec.effective_map, rec.maps[0] - 0.3 * rec.maps[1])
    v_heads = v.repeat_interleave(h // g, dim=1)
    torch.testing.assert_close(torch.matmul(rec.effective_map, v_heads), ref)
    assert not torch.allclose(torch.matmul(rec.maps[0], v_heads), ref)
    torch.testing.assert_close(rec.effective_map.sum(-1), torch.full((b, h, s), 0.7))
