"""Absmax logit quantization: the grid it rounds to, both DIFF maps, and 16 bits = the unquantized model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffmeg.errors import DiffmegError
from diffmeg.eval.quantize import Choice, absmax_quantizer, choice_scores, quantized, validation_loss
from diffmeg.kernels.reference import causal_keep_mask


def test_absmax_quantizer_rounds_visible_logits_to_the_grid():
    keep = causal_keep_mask(3, 3, torch.device("cpu"))
    logits = torch.tensor([[0.75, 100.0, 100.0], [-1.4, 0.35, 100.0], [0.2, -0.9, 1.05]]).view(1, 1, 3, 3)
    q = absmax_quantizer(4)(logits, keep)  # 7 steps of 1.4 / 7 = 0.2 (the masked 100s do not count)
    assert q[0, 0, 0, 0].item() == pytest.approx(0.8)  # 0.75 / 0.2 = 3.75 -> 4
    assert q[0, 0, 1, :2].tolist() == pytest.approx([-1.4, 0.4])
    assert q[0, 0, 2].tolist() == pytest.approx([0.2, -0.8, 1.0])
    with pytest.raises(DiffmegError, match="bit widths must be 2..15"):
        absmax_quantizer(1)


def test_16_bits_is_exactly_unquantized_and_4_bits_changes_the_loss(tiny_ckpts):
    from diffmeg.eval.capture import capture_attention
    from diffmeg.eval.common import CheckpointSet, loaded_models

    infos = CheckpointSet([str(tiny_ckpts["diff"]), str(tiny_ckpts["transformer"])]).resolve()
    windows = [np.random.default_rng(0).integers(0, 512, 33) for _ in range(2)]
    item = Choice(context=list(range(10, 30)), choices=[[1, 2], [3, 4, 5]], label=0)
    for info, model in loaded_models(infos):
        plain = validation_loss(model, windows)
        plain_scores = choice_scores(model, item)
        with quantized(model, 16):
            assert validation_loss(model, windows) == plain
            assert choice_scores(model, item) == plain_scores
        with quantized(model, 4):
            low = validation_loss(model, windows)
        assert low != plain and abs(low - plain) < 1.0
        assert validation_loss(model, windows) == plain  # the hooks are gone afterwards
        records = []
        with capture_attention(model, records.append, absmax_quantizer(4)):
            validation_loss(model, windows[:1])
        assert len(records) == 4 and all(
            len(r.logits) == (2 if info.architecture == "DIFF" else 1) for r in records
        )
        for rec in records:  # every map's visible logits sit on a 15-level grid
            for logits in rec.logits:
                levels = torch.unique(logits[0, 0][rec.keep])
                assert len(levels) <= 15
