"""Golden tests for DIFF V2: the whole model and its gradients against float64 equations, the KV cache."""

from __future__ import annotations

import pytest
import torch

from tests.builders import make_v2_config, perturbed_model
from tests.reference_model import reference_logits_v2, semantic_weights_v2_from_mcore


def _v2_model(heads, kv_heads, d, layers, noise=None):
    """lambda far from sigmoid's midpoint, norms away from one."""
    cfg = make_v2_config(heads, kv_heads, d, layers, noise=noise)
    return perturbed_model(cfg, torch.Generator().manual_seed(5), 0.5)


@pytest.mark.parametrize(
    "heads,kv_heads,noise,layers",
    # the pairs (n = h), then grouped differential attention: Motif-3's n = g, and n a multiple of g
    [(2, 2, 2, 1), (4, 2, 4, 3), (4, 1, 4, 2), (4, 2, 2, 2), (4, 1, 1, 2), (6, 1, 2, 2)],
)
def test_diff_v2_model_and_gradients_match_reference(
    single_rank_parallel_state, heads, kv_heads, noise, layers
):
    """Logits and every parameter's gradient (lambda_proj included) vs the float64 definition."""
    from diffmeg.attention_v2 import DiffV2SelfAttention

    d = 8
    model = _v2_model(heads, kv_heads, d, layers, noise)
    attention = model.decoder.layers[0].self_attention
    assert isinstance(attention, DiffV2SelfAttention)
    assert attention.linear_proj.weight.shape == (heads * d, heads * d)  # h x d in, hidden out
    assert attention.linear_lambda.weight.shape == (heads, heads * d)
    assert attention.linear_qkv.weight.shape == ((heads + noise + 2 * kv_heads) * d, heads * d)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (1, 13), generator=gen)
    logits = model(input_ids=tokens, position_ids=torch.arange(13)[None], attention_mask=None)  # [b, s, V]
    cfg = {"heads": heads, "kv_heads": kv_heads, "noise_heads": noise, "head_dim": d, "layers": layers}
    sd = {k: v.detach().clone().requires_grad_(True) for k, v in model.state_dict().items() if v is not None}
    weights = semantic_weights_v2_from_mcore(sd, cfg)
    ref = reference_logits_v2(tokens[0], weights, {"rotary_base": 500.0, **cfg})
    # megatron-core's RoPE frequencies are fp32: agreement to ~1e-9, not float64's 1e-15
    torch.testing.assert_close(logits[0], ref, rtol=1e-7, atol=1e-8)

    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (logits[0] * grad).sum().backward()
    (ref * grad).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, sd[name].grad, rtol=1e-6, atol=1e-8, msg=name)


@pytest.mark.parametrize("noise", [None, 2, 1])
def test_kv_cache_decoding_equals_full_recompute(single_rank_parallel_state, noise):
    """generate() with megatron-core's KV cache gives the logits of recomputing the whole prefix (grouped
    differential attention too)."""
    from diffmeg.generation import SamplingConfig, generate

    model = _v2_model(4, 2 if noise is None else noise, 8, 2, noise).eval()
    prompt = [3, 17, 5, 42, 8]
    cached = generate(model, prompt, 6, SamplingConfig(greedy=True), use_cache=True, return_logits=True)
    full = generate(model, prompt, 6, SamplingConfig(greedy=True), use_cache=False, return_logits=True)
    assert cached.output_ids == full.output_ids and len(cached.output_ids) == 6
    for a, b in zip(cached.step_logits, full.step_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_attention_heads=7), "even number of query heads"),
        (dict(num_query_groups=3), "3 KV heads must divide the 4 DIFF V2 heads"),
        (dict(tensor_model_parallel_size=8), "cannot be split over tensor-model-parallel-size 8"),
        (dict(context_parallel_size=16), "16 with --cp-comm-type ulysses shards whole query heads"),
        (dict(diff_version=3), "diff_version must be 1 or 2"),
    ],
)
def test_invalid_v2_configs(kw, match):
    from diffmeg.errors import DiffmegError

    base = dict(heads=4, kv_heads=4, head_dim=8)
    with pytest.raises(DiffmegError, match=match):
        cfg = make_v2_config(**base)
        for k, v in kw.items():  # re-validate with one field changed
            setattr(cfg, k, v)
        cfg.__post_init__()
