"""RoPE (diffmeg.fusions.rope): the compiled function against megatron-core's eager one, and the attention
hook (`--rope-impl`) giving every architecture's model the same logits and gradients as megatron-core's own
RoPE path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.builders import make_config, make_v2_config, perturbed_model


def _freqs(s: int, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    inv = 1.0 / (500.0 ** (torch.arange(0, d, 2, dtype=dtype) / d))
    angles = torch.outer(torch.arange(s, dtype=dtype), inv)  # [s, d/2]
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [s, 1, 1, d], megatron-core's layout


def test_compiled_rope_matches_megatron_cores_in_fp32():
    from diffmeg.fusions.rope import rope_compiled, rope_eager

    cfg = make_config()
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(6, 2, 3, 8, generator=gen, requires_grad=True)
    freqs = _freqs(6, 8)
    got, want = rope_compiled(t, freqs, cfg), rope_eager(t, freqs, cfg)
    torch.testing.assert_close(got, want)
    grad = torch.randn(got.shape, generator=gen)
    torch.testing.assert_close(torch.autograd.grad(got, t, grad)[0], torch.autograd.grad(want, t, grad)[0])


def test_rope_eager_is_the_rotation_in_float64():
    from diffmeg.fusions.rope import rope_eager

    t = torch.randn(5, 1, 2, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    freqs = _freqs(5, 8, torch.float64)
    half = t.shape[-1] // 2
    x1, x2 = t[..., :half], t[..., half:]
    cos, sin = torch.cos(freqs[..., :half]), torch.sin(freqs[..., :half])
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # pairs (i, i + d/2) rotated
    torch.testing.assert_close(rope_eager(t, freqs, make_config()), want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("arch", ["v1", "v2", "transformer"])
def test_rope_hook_gives_megatron_cores_logits_and_gradients(single_rank_parallel_state, monkeypatch, arch):
    """`rope_impl='compiled'` swaps the attention class; with the compiled function replaced by the eager
    one (a spy), the float64 model must equal megatron-core's RoPE path exactly, and q and k of every layer
    go through the hook once per forward."""
    from diffmeg.fusions import rope

    calls = []

    def spy(t, freqs, config):
        calls.append(t.shape)
        return rope.rope_eager(t, freqs, config)

    monkeypatch.setattr(rope, "rope_compiled", spy)
    cfg = {
        "v1": make_config(4, 2, 8, 2),
        "v2": make_v2_config(4, 2, 8, 2),
        "transformer": make_config(4, 2, 8, 2, diff_attention=False),
    }[arch]
    models = [
        perturbed_model(dataclasses.replace(cfg, rope_impl=impl), torch.Generator().manual_seed(5), 0.5)
        for impl in ("auto", "compiled")
    ]
    attention = [m.decoder.layers[0].self_attention for m in models]
    assert not isinstance(attention[0], rope.FusedRopeMixin) and isinstance(attention[1], rope.FusedRopeMixin)
    gen = torch.Generator().manual_seed(7)
    tokens, labels = torch.randint(0, 64, (2, 2, 9), generator=gen)
    positions = torch.arange(9)[None].expand(2, 9)
    losses = [m(input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels) for m in models]
    assert len(calls) == 2 * cfg.num_layers
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-14, atol=1e-14)
    for loss in losses:
        loss.mean().backward()
    for (name, a), (_, b) in zip(*(m.named_parameters() for m in models), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-14, msg=name)
