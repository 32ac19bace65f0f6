"""Small model configurations shared by the tests: the architecture pretrain_diff.py builds, in one place."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffmeg.config import DiffTransformerConfig


def tiny_config(
    heads: int,
    kv_heads: int | None,
    head_dim: int,
    layers: int = 1,
    *,
    ffn: int | None = 32,
    noise: int | None = None,
    **fields,
) -> DiffTransformerConfig:
    """h DIFF heads over g DIFF KV heads of width d, counted as megatron-core counts them: V1 2h sub-heads
    in 2g sub-groups, hidden 2hd (its FLOP-matched baseline, `diff_attention=False`, the same 2h heads of
    d); V2 (`diff_version=2`) 2h query heads over g KV heads, hidden hd. pretrain_diff.py's architecture
    (pre-RMSNorm, SwiGLU, no biases), no dropout, initialised on the CPU. `kv_heads` or `ffn` None leaves
    megatron-core to fill them in; `noise` n: grouped differential attention's noise heads (h + n query
    heads; None: the 1:1 DIFF); `fields` set anything else (or override the above)."""
    sub = 1 if fields.get("diff_version", 1) == 2 else 2
    if noise is not None:
        fields = {"num_noise_heads": noise, **fields}
    values = dict(
        num_layers=layers,
        hidden_size=sub * heads * head_dim,
        num_attention_heads=heads + (heads if noise is None else noise),
        num_query_groups=None if kv_heads is None else sub * kv_heads,
        kv_channels=head_dim,
        ffn_hidden_size=ffn,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    values.update(fields)
    return DiffTransformerConfig(**values)


def make_config(heads: int = 4, kv_heads: int = 4, head_dim: int = 8, layers: int = 1, **fields):
    """The float64 DIFF V1 model of the golden tests (`tiny_config` with float64 parameters)."""
    return tiny_config(heads, kv_heads, head_dim, layers, params_dtype=torch.float64, **fields)


def make_v2_config(heads: int = 4, kv_heads: int = 4, head_dim: int = 8, layers: int = 1, **fields):
    """The float64 DIFF V2 model of the golden tests: h output heads, 2h query heads over g KV heads."""
    return make_config(heads, kv_heads, head_dim, layers, diff_version=2, **fields)


def perturbed_model(cfg: DiffTransformerConfig, gen: torch.Generator, lambda_std: float, vocab: int = 64):
    """The float64 GPTModel of `cfg` (RoPE base 500, seed 3) with its lambda parameters redrawn from `gen`
    (std `lambda_std`: far from their init) and its norm weights moved off one, so that a wrong lambda or
    norm weight shows in the logits."""
    from diffmeg.model import build_model

    model = build_model(cfg, vocab_size=vocab, max_sequence_length=16, rotary_base=500.0, seed=3).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * lambda_std)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def load_model(root, iteration: int | None = None, dtype: torch.dtype = torch.float32):
    """(model, args) of a checkpoint as one TP=PP=1 model in eval mode, whatever layout saved it."""
    from diffmeg.checkpoints import load_model_weights
    from diffmeg.runtime import single_process

    single_process()
    return load_model_weights(root, iteration, dtype)
