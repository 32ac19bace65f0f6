"""The Transformer baseline <-> Llama mapping: exact inverses, and megatron-core's own baseline computing
the float64 logits of transformers' Llama equations from the mapped weights (QKV layout, RoPE convention).

`llama_logits` below is written from transformers' `LlamaAttention` / `LlamaMLP` (q_proj heads, repeat_kv
sending query head m to KV head m // r, rotate-half RoPE). The real transformers model is compared in
tests/conversion/test_hf_import.py.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from diffmeg.conversion.hf_config import (
    hf_config_dict,
    layout_from_args,
    layout_from_hf_config,
    pretrain_flags,
)
from diffmeg.conversion.layout import LlamaLayout
from diffmeg.conversion.mapping import (
    fuse_qkv_llama,
    hf_to_mcore,
    mcore_to_hf,
    split_fused_qkv_llama,
)
from diffmeg.errors import DiffmegError
from tests.conversion.test_mapping import flatten
from tests.reference_model import rmsnorm, rope

LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1), "gqa-r3": (6, 2)}  # (n heads, g KV heads)


def make_layout(n: int, g: int, layers: int = 2, eps: float = 1e-6) -> LlamaLayout:
    return LlamaLayout(
        num_layers=layers,
        hidden_size=32,
        ffn_hidden_size=48,
        num_heads=n,
        num_kv_heads=g,
        head_dim=8,
        vocab_size=50,
        max_position_embeddings=32,
        rotary_base=500.0,
        norm_eps=eps,
    )


def random_mcore(layout: LlamaLayout, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = dict(layout.mcore_global_shapes())
    for i in range(layout.num_layers):
        shapes.update({f"decoder.layers.{i}.{k}": s for k, s in layout.mcore_layer_shapes().items()})
    sd = {}
    for name, shape in shapes.items():
        if "norm" in name:
            sd[name] = torch.empty(shape, dtype=dtype).uniform_(0.5, 1.5, generator=gen)
        else:
            sd[name] = torch.randn(shape, generator=gen, dtype=dtype) * 0.2
    return sd


def llama_logits(tokens: torch.Tensor, sd: dict, config: dict) -> torch.Tensor:
    """float64 logits of a Llama state dict, following transformers' LlamaAttention step by step."""
    n_heads, n_kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps, theta = config["rms_norm_eps"], config["rope_parameters"]["rope_theta"]
    s = tokens.numel()
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    x = sd["model.embed_tokens.weight"][tokens]
    for li in range(config["num_hidden_layers"]):
        p = f"model.layers.{li}."
        hn = rmsnorm(x, sd[p + "input_layernorm.weight"], eps)
        q = rope((hn @ sd[p + "self_attn.q_proj.weight"].T).view(s, n_heads, d), theta)
        k = rope((hn @ sd[p + "self_attn.k_proj.weight"].T).view(s, n_kv, d), theta)
        v = (hn @ sd[p + "self_attn.v_proj.weight"].T).view(s, n_kv, d)
        outs = []
        for m in range(n_heads):
            kv = m // (n_heads // n_kv)  # repeat_kv
            a = torch.softmax((q[:, m] @ k[:, kv].T / math.sqrt(d)).masked_fill(~causal, -math.inf), -1)
            outs.append(a @ v[:, kv])
        x = x + torch.cat(outs, -1) @ sd[p + "self_attn.o_proj.weight"].T
        hn = rmsnorm(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = hn @ sd[p + "mlp.gate_proj.weight"].T, hn @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rmsnorm(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


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


def baseline_args(**overrides) -> argparse.Namespace:
    values = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        vocab_size=50,
        max_position_embeddings=32,
        rotary_base=500.0,
        norm_epsilon=1e-6,
        lambda_init=0.5,  # ignored: no lambda in the baseline
        diff_attention=False,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def test_baseline_args_give_a_llama_layout_that_round_trips_through_pretrain_flags():
    from diffmeg.training.arguments import resolve_args

    layout = layout_from_args(baseline_args())
    assert layout == make_layout(4, 2)
    flags = pretrain_flags(layout)
    assert "--no-diff-attention" in flags and "--lambda-init" not in flags
    argv = [*flags, "--seq-length", "32", "--lr", "1e-4", "--train-iters", "1", "--mock-data"]
    assert layout_from_args(resolve_args(argv)) == layout


def llama_config(**overrides) -> dict:
    config = hf_config_dict(make_layout(4, 2), dtype="float32", bos_token_id=None, eos_token_id=None)
    config["model_type"] = "llama"
    config.update(overrides)
    return config


def test_layout_from_llama_config_inverts_hf_config_dict():
    config = llama_config()
    assert config["architectures"] == ["LlamaForCausalLM"] and "lambda_std_dev" not in config
    assert layout_from_hf_config(config) == (make_layout(4, 2), False)
    legacy = llama_config(rope_parameters=None, rope_theta=500.0, tie_word_embeddings=True, head_dim=None)
    assert layout_from_hf_config(legacy) == (make_layout(4, 2), True)  # head_dim = hidden / heads


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "scaled RoPE"),
        ({"attention_bias": True}, "biases are not supported"),
        ({"mlp_bias": True}, "biases are not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "do not divide"),
    ],
)
def test_llama_configs_our_model_cannot_express_are_refused(overrides, message):
    with pytest.raises(DiffmegError, match=message):
        layout_from_hf_config(llama_config(**overrides))
