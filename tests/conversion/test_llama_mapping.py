"""The Transformer baseline <-> Llama mapping: exact inverses, and megatron-core's own baseline computing
the float64 logits of transformers' Llama equations from the mapped weights (QKV layout, RoPE convention).

`llama_logits` below is written from transformers' `LlamaAttention` / `LlamaMLP` (q_proj heads, repeat_kv
sending query head m to KV head m // r, rotate-half RoPE). The real transformers model is compared in
tests/conversion/test_hf_import.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffmeg.conversion.hf_config import (
    hf_config_dict,
    layout_from_args,
    layout_from_hf_config,
    pretrain_flags,
)
from diffmeg.conversion.layout import LlamaLayout
from diffmeg.conversion.mapping import fuse_qkv_llama, hf_to_mcore, mcore_to_hf, split_fused_qkv_llama
from diffmeg.errors import DiffmegError
from tests.conversion import layouts
from tests.conversion.layouts import flatten, hf_config, random_mcore

LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1), "gqa-r3": (6, 2)}  # (n heads, g KV heads)


def make_layout(n: int, g: int, layers: int = 2, eps: float = 1e-6) -> LlamaLayout:
    return layouts.tiny_layout(
        LlamaLayout, n, g, layers, hidden_size=32, ffn_hidden_size=48, head_dim=8, norm_eps=eps
    )


def llama_logits(tokens: torch.Tensor, sd: dict, config: dict) -> torch.Tensor:
    """float64 logits of a Llama state dict, following transformers' LlamaAttention step by step."""

    def attention(q, k, v, p, li):  # q [s, n, d], k and v [s, g, d]
        return torch.cat([a @ v[:, kv] for a, kv in layouts.causal_maps(q, k)], -1)

    return layouts.llama_family_logits(tokens, sd, config, attention)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qkv_split_and_fuse_are_inverse_and_follow_megatron_groups(name):
    n, g = LAYOUTS[name]
    layout = make_layout(n, g)
    qkv = random_mcore(layout)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = split_fused_qkv_llama(qkv, layout)
    assert torch.equal(fuse_qkv_llama(q, k, v, layout), qkv)
    d, r = layout.head_dim, n // g
    rows = qkv.view(g, r + 2, d, -1)  # megatron-core: per query group [r queries, key, value]
    for m in range(n):
        assert torch.equal(q.view(n, d, -1)[m], rows[m // r, m % r])  # Llama head m, its KV head m // r
    for j in range(g):
        assert torch.equal(k.view(g, d, -1)[j], rows[j, r]) and torch.equal(
            v.view(g, d, -1)[j], rows[j, r + 1]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trips_are_identical_both_ways(dtype):
    layout = make_layout(4, 2)
    sd = random_mcore(layout, seed=3, dtype=dtype)
    hf = flatten(mcore_to_hf(sd, layout))
    back = flatten(hf_to_mcore(hf, layout))
    assert back.keys() == sd.keys()
    for key in sd:
        assert back[key].dtype == dtype and torch.equal(back[key], sd[key]), key
    again = flatten(mcore_to_hf(back, layout))
    assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)
    assert set(hf) == {f"model.layers.{i}.{k}" for i in range(2) for k in layout.hf_layer_shapes()} | set(
        layout.hf_global_shapes()
    )


@pytest.mark.parametrize("name", ["mha", "gqa", "gqa-r3"])
def test_megatron_core_baseline_computes_llama_logits(single_rank_parallel_state, name):
    """Golden: the weights of a float64 Llama mapped into our megatron-core baseline (fp32, TP=1) give
    its logits: our QKV de-interleave and megatron-core's rotate-half RoPE are transformers'."""
    from diffmeg.checkpoints import build_single_rank_model
    from diffmeg.conversion.checkpoint_io import fill_model
    from diffmeg.conversion.hf_import import resolved_pretrain_args
    from tests.conversion.helpers import our_logits

    n, g = LAYOUTS[name]
    layout = make_layout(n, g, eps=1e-6)
    hf = flatten(mcore_to_hf(random_mcore(layout, seed=7), layout))
    config = hf_config_dict(layout, dtype="float64", bos_token_id=None, eos_token_id=None)
    args = resolved_pretrain_args(layout, config)
    assert args.diff_attention is False and layout_from_args(args) == layout
    model = build_single_rank_model(args)
    fill_model(model, hf_to_mcore(hf, layout, torch.float32))
    model.eval()
    tokens = torch.randint(0, layout.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    theirs = llama_logits(tokens, hf, config)
    ours = our_logits(model, tokens).double()
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    assert err < 1e-5, err  # fp32 rounding only (measured ~2e-7); a wrong head order or RoPE is O(1)


def test_baseline_args_give_a_llama_layout_that_round_trips_through_pretrain_flags():
    layout = make_layout(4, 2)
    args = layouts.layout_args(layout, lambda_init=0.5)  # ignored: no lambda in the baseline
    assert layout_from_args(args) == layout
    flags = pretrain_flags(layout)
    assert "--no-diff-attention" in flags and "--lambda-init" not in flags
    assert layout_from_args(layouts.pretrain_args(layout)) == layout


def test_layout_from_llama_config_inverts_hf_config_dict():
    config = hf_config(make_layout(4, 2))
    assert config["architectures"] == ["LlamaForCausalLM"] and "lambda_std_dev" not in config
    assert layout_from_hf_config(config) == make_layout(4, 2)
    legacy = hf_config(
        make_layout(4, 2), rope_parameters=None, rope_theta=500.0, tie_word_embeddings=True, head_dim=None
    )
    tied = dataclasses.replace(make_layout(4, 2), tied=True)
    assert layout_from_hf_config(legacy) == tied  # head_dim = hidden / heads


@pytest.mark.parametrize(
    "overrides, message",
    [
        *layouts.REFUSED_BY_EVERY_LAYOUT,
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "scaled RoPE"),
        ({"mlp_bias": True}, "biases are not supported"),
        ({"num_key_value_heads": 3}, "do not divide"),
    ],
)
def test_llama_configs_our_model_cannot_express_are_refused(overrides, message):
    with pytest.raises(DiffmegError, match=message):
        layout_from_hf_config(hf_config(make_layout(4, 2), **overrides))
