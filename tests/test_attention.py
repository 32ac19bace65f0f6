"""Golden tests: DiffCoreAttention and the whole model against the float64 equations."""

from __future__ import annotations

import pytest
import torch

from tests.builders import make_config, perturbed_model
from tests.reference_model import diff_heads, lambda_init, reference_logits, semantic_weights_from_mcore

# (h, g, n): the paper's pairs (n = h), and grouped differential attention (n < h: r = h / n signal heads
# share a noise head, layout [signal x r, noise]).
HEAD_LAYOUTS = [(4, 4, 4), (4, 2, 4), (4, 1, 4), (4, 2, 2), (4, 1, 1), (6, 1, 2), (6, 3, 3)]


@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa_split_v", "sdpa_split_v_batched"])
@pytest.mark.parametrize("heads,kv_heads,noise", HEAD_LAYOUTS)
@pytest.mark.parametrize("layer_number", [1, 12])
def test_core_attention_matches_equations(
    single_rank_parallel_state, backend, heads, kv_heads, noise, layer_number
):
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention

    d, s, b = 8, 11, 2
    cfg = make_config(heads, kv_heads, d, diff_attn_backend=backend, noise=noise)
    core = DiffCoreAttention(cfg, layer_number, AttnMaskType.causal, "self").double()
    gen = torch.Generator().manual_seed(layer_number * 10 + heads + kv_heads + noise)
    with torch.no_grad():  # lambda far from its init (exp terms ~ e^{+-1}), non-trivial norm weight
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(core, name).copy_(torch.randn(d, generator=gen, dtype=torch.float64) * 0.5)
        core.head_norm.weight.copy_(1 + 0.3 * torch.randn(2 * d, generator=gen, dtype=torch.float64))
    q = torch.randn(s, b, heads + noise, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, b, 2 * kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, b, 2 * kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    out = core(q, k, v, None)
    assert out.shape == (s, b, heads * 2 * d)

    params = [core.lambda_q1, core.lambda_k1, core.lambda_q2, core.lambda_k2, core.head_norm.weight]
    ref_params = [p.detach().clone().requires_grad_(True) for p in params]
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref, r = [], heads // noise
    for bi in range(b):  # per batch element, sub-heads split by the documented group layout
        groups = qr[:, bi].view(s, noise, r + 1, d)  # [signal x r, noise] per group
        q1 = groups[:, :, :r].reshape(s, heads, d).transpose(0, 1)  # [h, s, d]
        q2 = groups[:, :, r].transpose(0, 1)  # [n, s, d]
        k1, k2 = kr[:, bi, 0::2].transpose(0, 1), kr[:, bi, 1::2].transpose(0, 1)  # [g, s, d]
        vv = torch.cat([vr[:, bi, 0::2], vr[:, bi, 1::2]], dim=-1).transpose(0, 1)  # [g, s, 2d]
        ref.append(diff_heads(q1, q2, k1, k2, vv, *ref_params, lambda_init(layer_number - 1)))
    ref = torch.stack(ref, dim=1)  # [s, b, h*2d]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)

    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    for mine, theirs in zip([q, k, v, *params], [qr, kr, vr, *ref_params], strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-10)


def test_constant_lambda_init(single_rank_parallel_state):
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention

    cfg = make_config(lambda_init=0.5)
    assert DiffCoreAttention(cfg, 7, AttnMaskType.causal, "self").lambda_init == 0.5
    cfg = make_config()
    assert DiffCoreAttention(cfg, 7, AttnMaskType.causal, "self").lambda_init == pytest.approx(lambda_init(6))


@pytest.mark.parametrize("noise", [None, 2])
def test_kv_cache_step_is_causal_at_the_end(single_rank_parallel_state, noise):
    """A decode step (sq < sk) must equal the last rows of the full-sequence attention."""
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention

    queries = 8 if noise is None else 4 + noise
    for backend in ("reference", "sdpa"):
        cfg = make_config(diff_attn_backend=backend, noise=noise, num_query_groups=8 if noise is None else 4)
        core = DiffCoreAttention(cfg, 2, AttnMaskType.causal, "self").double()
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(9, 1, queries, 8, generator=gen, dtype=torch.float64)
        groups = cfg.num_query_groups
        k, v = (torch.randn(9, 1, groups, 8, generator=gen, dtype=torch.float64) for _ in range(2))
        full = core(q, k, v, None)
        torch.testing.assert_close(core(q[-3:], k, v, None), full[-3:])


@pytest.mark.parametrize("noise", [2, 1])
def test_grouped_model_kv_cache_decoding_equals_full_recompute(single_rank_parallel_state, noise):
    """generate() with megatron-core's KV cache through the grouped V1 model (its spread fused QKV for 5
    query sub-heads over 2 sub-groups) gives the logits of recomputing the whole prefix."""
    from diffmeg.generation import SamplingConfig, generate

    cfg = make_config(4, 1, 8, 2, noise=noise)
    model = perturbed_model(cfg, torch.Generator().manual_seed(2), 0.4).eval()
    prompt = [3, 17, 5, 42, 8]
    cached = generate(model, prompt, 6, SamplingConfig(greedy=True), use_cache=True, return_logits=True)
    full = generate(model, prompt, 6, SamplingConfig(greedy=True), use_cache=False, return_logits=True)
    assert cached.output_ids == full.output_ids and len(cached.output_ids) == 6
    for a, b in zip(cached.step_logits, full.step_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "heads,kv_heads,noise",
    # the 1:1 pairs; GDA whose h + n query sub-heads divide the 2g K/V sub-groups (megatron-core's fused QKV
    # layout) and GDA whose do not (5 over 2, 6 over 4, 40 over 16 in Motif-2-12.7B: spread evenly)
    [(2, 2, 2), (2, 1, 2), (4, 1, 2), (4, 1, 1), (4, 2, 2), (8, 2, 2)],
)
def test_full_model_matches_reference(single_rank_parallel_state, heads, kv_heads, noise):
    """Whole GPTModel (embedding, RoPE, fused QKV layout, SwiGLU, norms) vs the float64 equations: logits
    and every parameter's gradient (lambda vectors and head norm included)."""
    from diffmeg.self_attention import DiffSelfAttention

    d, layers = 8, 3
    cfg = make_config(heads, kv_heads, d, layers=layers, noise=noise)
    gen = torch.Generator().manual_seed(5)
    model = perturbed_model(cfg, gen, lambda_std=0.4)
    attention = model.decoder.layers[0].self_attention
    assert isinstance(attention, DiffSelfAttention)
    assert attention.linear_proj.weight.shape == (2 * heads * d, heads * 2 * d)  # h x 2d in, hidden out
    assert attention.linear_qkv.weight.shape == ((heads + noise + 4 * kv_heads) * d, 2 * heads * d)
    tokens = torch.randint(0, 64, (1, 13), generator=gen)
    logits = model(input_ids=tokens, position_ids=torch.arange(13)[None], attention_mask=None)  # [b, s, V]
    sd = {k: v.detach().clone().requires_grad_(True) for k, v in model.state_dict().items() if v is not None}
    w = semantic_weights_from_mcore(
        sd, {"heads": heads, "kv_heads": kv_heads, "noise_heads": noise, "head_dim": d, "layers": layers}
    )
    ref = reference_logits(tokens[0], w, {"rotary_base": 500.0})
    # megatron-core's RoPE frequencies are fp32: agreement to ~1e-9, not float64's 1e-15
    torch.testing.assert_close(logits[0], ref, rtol=1e-7, atol=1e-8)

    weights = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (logits[0] * weights).sum().backward()
    (ref * weights).sum().backward()
    # Relative to each gradient's largest entry. RoPE's fp32 frequencies perturb q and k by ~1e-9; the lambda
    # vectors' gradients are sums that cancel to ~1e-3 of their terms, which amplifies that to ~1e-6 (the
    # float64 core test above holds them to 1e-9); a layout error is of the gradient's own size.
    for name, p in model.named_parameters():
        error = (p.grad - sd[name].grad).abs().max() / sd[name].grad.abs().max()
        assert error < (3e-5 if "lambda" in name else 1e-6), (name, error.item())


def test_core_attention_with_torch_norm_matches_the_eager_core(single_rank_parallel_state):
    """`norm_impl='torch'` changes the head norm's kernel, not the math: float64 values and gradients."""
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention
    from diffmeg.fusions.rms_norm import rms_norm_torch

    d, s, b, gen = 8, 7, 2, torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(s, b, 4, d, generator=gen, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(s, b, 2 * 2 * d, generator=gen, dtype=torch.float64)
    results = []
    for norm_impl in ("torch", "auto"):
        core = DiffCoreAttention(make_config(2, 2, d, norm_impl=norm_impl), 2, AttnMaskType.causal, "self")
        core = core.double()
        with torch.no_grad():
            core.head_norm.weight.copy_(torch.linspace(0.5, 1.5, 2 * d, dtype=torch.float64))
            for i, name in enumerate(("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")):
                getattr(core, name).copy_(torch.linspace(-0.5, 0.5, d, dtype=torch.float64) * (i + 1))
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = core(*inputs, None)
        results.append((out, *torch.autograd.grad(out, [*inputs, core.head_norm.weight], grad)))
        assert (core.head_norm.norm_fn is rms_norm_torch) == (norm_impl == "torch")
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("noise", [None, 1])
def test_motif_shaped_model_matches_reference(single_rank_parallel_state, noise):
    """Motif's model (PolyNorm MLP, its lambda_init schedule, grouped V1 attention or the 1:1 pairs) vs the
    float64 equations: logits and every gradient, PolyNorm's weights included."""
    heads, kv_heads, d, layers = 4, 1, 8, 3
    motif = {"mlp_activation": "poly_norm", "lambda_init": "motif"}
    cfg = make_config(heads, kv_heads, d, layers=layers, noise=noise, **motif)
    gen = torch.Generator().manual_seed(8)
    model = perturbed_model(cfg, gen, lambda_std=0.4)
    with torch.no_grad():  # PolyNorm's weights off their init (1/3, 0)
        for name, p in model.named_parameters():
            if ".poly_norm." in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    core = model.decoder.layers[0].self_attention.core_attention
    assert core.lambda_init == pytest.approx(lambda_init(-1))  # Motif's first layer: -0.01
    tokens = torch.randint(0, 64, (1, 13), generator=gen)
    logits = model(input_ids=tokens, position_ids=torch.arange(13)[None], attention_mask=None)
    sd = {k: v.detach().clone().requires_grad_(True) for k, v in model.state_dict().items() if v is not None}
    shape = {"heads": heads, "kv_heads": kv_heads, "noise_heads": noise or heads, "head_dim": d}
    shape["layers"] = layers
    w = semantic_weights_from_mcore(sd, shape)
    assert all("poly_w" in layer for layer in w["layers"])
    ref = reference_logits(tokens[0], w, {"rotary_base": 500.0, "lambda_init": "motif"})
    torch.testing.assert_close(logits[0], ref, rtol=1e-7, atol=1e-8)
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (logits[0] * grad).sum().backward()
    (ref * grad).sum().backward()
    for name, p in model.named_parameters():  # as in test_full_model_matches_reference
        error = (p.grad - sd[name].grad).abs().max() / sd[name].grad.abs().max()
        assert error < (3e-5 if "lambda" in name else 1e-6), (name, error.item())
