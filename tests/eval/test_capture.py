"""Attention capture against the model's own computation, in float64: for DIFF V1, the Transformer
baseline (whatever core the local spec builds for it) and DIFF V2, the captured maps are the ones the
output is made of, reading them changes no logit, and everything is restored afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffmeg.eval.capture import AttentionRecord, _sdpa, capture_attention, decoder_layers
from tests.builders import make_config, make_v2_config


def _model(kind: str, layers: int = 2):
    from diffmeg.model import build_model

    if kind in ("v2", "gda_v2"):  # gda: grouped differential attention, 2 signal heads over 1 noise head
        noise = 1 if kind == "gda_v2" else None
        cfg = make_v2_config(heads=2, kv_heads=1, head_dim=8, layers=layers, noise=noise)
    elif kind == "gda":
        cfg = make_config(heads=2, kv_heads=1, head_dim=8, layers=layers, noise=1)
    else:
        cfg = make_config(heads=2, kv_heads=1, head_dim=8, layers=layers, diff_attention=kind == "diff")
    model = build_model(cfg, vocab_size=64, max_sequence_length=32, rotary_base=500.0, seed=3).double()
    with torch.no_grad():  # lambda away from its init: a record that ignored it would be caught
        gen = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if "lambda" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=torch.arange(tokens.shape[1])[None], attention_mask=None)


@pytest.mark.parametrize("kind", ["diff", "baseline", "v2", "gda", "gda_v2"])
def test_capture_changes_no_logit_and_reports_every_layer(single_rank_parallel_state, kind):
    from diffmeg.attention_v2 import DiffV2SelfAttention

    model = _model(kind)
    is_v2 = isinstance(decoder_layers(model)[0].self_attention, DiffV2SelfAttention)
    assert is_v2 == (kind in ("v2", "gda_v2"))
    tokens = torch.randint(0, 64, (1, 13), generator=torch.Generator().manual_seed(1))
    plain = _logits(model, tokens)
    records: list[AttentionRecord] = []
    with capture_attention(model, records.append):
        captured = _logits(model, tokens)
    torch.testing.assert_close(captured, plain, rtol=1e-10, atol=1e-10)
    assert [r.layer for r in records] == [0, 1]
    for rec in records:
        assert rec.kind == ("softmax" if kind == "baseline" else "diff")
        heads = 4 if kind == "baseline" else 2  # the baseline's 2h heads; DIFF's h heads, two maps each
        assert len(rec.maps) == len(rec.logits) == (1 if kind == "baseline" else 2)
        for m in rec.maps:
            assert m.dtype == torch.float64 and m.shape == (1, heads, 13, 13)
            torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1], dtype=torch.float64))
            assert not m[..., ~rec.keep].any()  # nothing attends to a later token
        if is_v2:  # per-token, per-head lambda in (0, 1)
            assert rec.lam.shape == (1, 2, 13, 1) and 0 < rec.lam.min() and rec.lam.max() < 1
        elif kind != "baseline":
            assert isinstance(rec.lam, float)
        if kind.startswith("gda"):  # both signal heads subtract their group's one noise map
            torch.testing.assert_close(rec.maps[1][:, 0], rec.maps[1][:, 1], rtol=0, atol=0)
    with capture_attention(model, records.append, lambda logits, keep: logits * 0.0):  # uniform maps
        flattened = _logits(model, tokens)
    assert not torch.allclose(flattened, plain)
    records.clear()
    torch.testing.assert_close(_logits(model, tokens), plain, rtol=0, atol=0)  # restored on exit
    assert not records
    cores = [layer.self_attention.core_attention for layer in decoder_layers(model)]
    assert all(core.override is None for core in cores)


def _qkv(heads: int, groups: int, sq: int, sk: int, d: int = 8):
    gen = torch.Generator().manual_seed(heads * 100 + groups * 10 + sq)
    q = torch.randn(2, heads, sq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, groups, sk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("masking", ["causal", "explicit", "none"])
def test_the_capturing_sdpa_is_torch_sdpa(groups, masking):
    """Same arguments, same result as torch's SDPA (GQA, causal, explicit and no mask); the maps it
    reports are the ones the output is made of."""
    q, k, v = _qkv(4, groups, 9, 9)
    kw = {"scale": 0.3, "enable_gqa": groups != 4}
    if masking == "causal":
        kw["is_causal"] = True
    elif masking == "explicit":
        kw["attn_mask"] = torch.rand(9, 9, generator=torch.Generator().manual_seed(0)) > 0.4
        kw["attn_mask"].fill_diagonal_(True)  # every query sees at least one key
    records: list[AttentionRecord] = []
    out = _sdpa(0, records.append, None, None)(q, k, v, **kw)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw))
    (rec,) = records
    v_heads = v.repeat_interleave(4 // groups, dim=1)  # query head j reads KV head j // (4 / groups)
    torch.testing.assert_close(torch.matmul(rec.effective_map, v_heads), out)
    if masking == "causal":
        assert torch.equal(rec.keep, torch.ones(9, 9, dtype=torch.bool).tril())


@pytest.mark.parametrize("ratio", [1, 3])
def test_diff_v2_heads_are_reported_as_pairs_with_their_lambda(ratio):
    """Heads 2i and 2i+1 become A1 and A2 of pair i (ratio 1; with grouped differential attention, each of
    a group's `ratio` signal heads and the group's noise head); the pair's effective map times V is DIFF
    V2's combined output (`combine_head_groups`)."""
    from diffmeg.fusions.diff_combine import combine_head_groups

    h = 2 * ratio  # 2 groups of `ratio` signal heads: h + 2 query heads
    q, k, v = _qkv(h + 2, 1, 7, 7)
    lam = torch.rand(7, 2, h, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # [s, b, h]
    records: list[AttentionRecord] = []
    out = _sdpa(0, records.append, None, SimpleNamespace(lam=lam, noise_ratio=ratio))(
        q, k, v, is_causal=True, scale=0.3, enable_gqa=True
    )
    (rec,) = records
    assert rec.kind == "diff" and rec.lam.shape == (2, h, 7, 1)
    combined = combine_head_groups(out.permute(2, 0, 1, 3).reshape(7, 2, -1), lam, ratio)  # [s, b, h * d]
    pairs = torch.matmul(rec.effective_map, v.expand(2, h, 7, 8))  # [b, h, s, d]
    torch.testing.assert_close(pairs.permute(2, 0, 1, 3).reshape(7, 2, -1), combined)
    assert rec.mean_lambda == pytest.approx(float(lam.mean()))
