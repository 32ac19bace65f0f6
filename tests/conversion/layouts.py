"""Tiny layouts for the pure mapping tests (DIFF <-> DiffLlama, baseline <-> Llama): random megatron-core
state dicts, the pretrain_diff.py args and config.json that describe a layout, and the float64 skeleton of
transformers' Llama-family forward pass that both Hugging Face references share."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable

import torch

from diffmeg.conversion.hf_config import hf_config_dict, pretrain_flags
from diffmeg.conversion.layout import ModelLayout
from tests.reference_model import rmsnorm, rope

ARG_OF_FIELD = {  # pretrain_diff.py's names of the layout fields that it names differently
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_query_groups",
    "head_dim": "kv_channels",
    "norm_eps": "norm_epsilon",
    "tied": "tie_embeddings_and_output_weights",
}


REFUSED_BY_EVERY_LAYOUT = [  # config.json overrides no Llama-family layout can express, and the error's words
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"attention_bias": True}, "biases are not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
]


def tiny_layout(cls: type[ModelLayout], heads: int, kv_heads: int, layers: int = 2, **sizes) -> ModelLayout:
    """`cls` with `sizes` (hidden_size, ffn_hidden_size, head_dim, norm_eps) over a vocabulary of 50,
    32 positions and RoPE base 500: small enough for float64 references."""
    return cls(
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=50,
        max_position_embeddings=32,
        rotary_base=500.0,
        **sizes,
    )


def random_mcore(layout: ModelLayout, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """A TP=1 megatron-core state dict with every tensor away from its init (norms, DIFF's lambdas too)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    shapes = dict(layout.mcore_global_shapes())
    for i in range(layout.num_layers):
        shapes.update({f"decoder.layers.{i}.{k}": s for k, s in layout.mcore_layer_shapes().items()})
    for name, shape in shapes.items():
        if "norm" in name:
            sd[name] = torch.empty(shape, dtype=dtype).uniform_(0.5, 1.5, generator=gen)
        elif "lambda" in name:
            sd[name] = torch.randn(shape, generator=gen, dtype=dtype) * 0.4
        else:
            sd[name] = torch.randn(shape, generator=gen, dtype=dtype) * 0.2
    return sd


def flatten(blocks: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for block in blocks:
        out.update(block)
    return out


def layout_args(layout: ModelLayout, **overrides) -> argparse.Namespace:
    """The resolved pretrain_diff.py args (as a checkpoint's args.json holds them) of `layout`'s model:
    DIFF with the paper's lambda schedule, or the baseline for a Llama layout."""
    values = {ARG_OF_FIELD.get(f.name, f.name): getattr(layout, f.name) for f in dataclasses.fields(layout)}
    values.update(lambda_init="exp", diff_attention=layout.model_type == "diffllama")
    values.update(overrides)
    return argparse.Namespace(**values)


def pretrain_args(layout: ModelLayout) -> argparse.Namespace:
    """What pretrain_diff.py resolves from `pretrain_flags(layout)` and a minimal run's flags."""
    from diffmeg.training.arguments import resolve_args

    run = ["--seq-length", "32", "--lr", "1e-4", "--train-iters", "1", "--mock-data"]
    return resolve_args([*pretrain_flags(layout), *run])


def hf_config(layout: ModelLayout, **overrides) -> dict:
    """`layout`'s config.json (float32, no special tokens) with `overrides`."""
    config = hf_config_dict(layout, dtype="float32", bos_token_id=None, eos_token_id=None)
    config["model_type"] = layout.model_type
    config.update(overrides)
    return config


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str, int], torch.Tensor]


def llama_family_logits(tokens: torch.Tensor, sd: dict, config: dict, attention: Attention) -> torch.Tensor:
    """float64 logits of a transformers Llama-family state dict, step by step: per layer pre-RMSNorm, the
    q/k/v projections with rotate-half RoPE, `attention(q, k, v, prefix, layer)` (q [s, n_heads, d], k and v
    [s, n_kv, d] -> o_proj's input [s, ...]), o_proj, then the pre-RMSNorm SwiGLU MLP."""
    n_heads, n_kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps, theta = config["rms_norm_eps"], config["rope_parameters"]["rope_theta"]
    s = tokens.numel()
    x = sd["model.embed_tokens.weight"][tokens]  # [s, H]
    for li in range(config["num_hidden_layers"]):
        p = f"model.layers.{li}."
        hn = rmsnorm(x, sd[p + "input_layernorm.weight"], eps)
        q = rope((hn @ sd[p + "self_attn.q_proj.weight"].T).view(s, n_heads, d), theta)
        k = rope((hn @ sd[p + "self_attn.k_proj.weight"].T).view(s, n_kv, d), theta)
        v = (hn @ sd[p + "self_attn.v_proj.weight"].T).view(s, n_kv, d)
        x = x + attention(q, k, v, p, li) @ sd[p + "self_attn.o_proj.weight"].T
        hn = rmsnorm(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = hn @ sd[p + "mlp.gate_proj.weight"].T, hn @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    lm_head = sd["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else sd["lm_head.weight"]
    return rmsnorm(x, sd["model.norm.weight"], eps) @ lm_head.T


def causal_maps(q: torch.Tensor, k: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """(causal softmax map [s, s], its KV head) of each query head m of q [s, n, d] over k [s, n_kv, d]:
    transformers' repeat_kv gives query head m the KV head m // (n / n_kv)."""
    s, n, d = q.shape
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    maps = []
    for m in range(n):
        kv = m // (n // k.shape[1])  # repeat_kv
        scores = (q[:, m] @ k[:, kv].T / math.sqrt(d)).masked_fill(~causal, -math.inf)
        maps.append((torch.softmax(scores, -1), kv))
    return maps
