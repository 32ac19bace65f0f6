"""Presets reproduce DESIGN.md's table, and the parameter counter matches the built model."""

from __future__ import annotations

import pytest
import torch

from diffmeg.presets import PRESETS, count_parameters, get_preset, swiglu_ffn_size
from tests.builders import tiny_config

# The paper names its models by parameters counting the embedding matrix once (its models have no
# separate output matrix in the count): counted that way the scaling sizes land on their names.
PAPER_SIZES = {
    "diff-830m": 0.83e9,
    "diff-1.4b": 1.4e9,
    "diff-2.8b": 2.8e9,
    "diff-6.8b": 6.8e9,
    "diff-13b": 13.1e9,
}


def _count(p, untie=True):
    return count_parameters(
        p["num_layers"],
        p["hidden_size"],
        p["ffn_hidden_size"],
        p["vocab_size"],
        p["num_attention_heads"],
        p["kv_channels"],
        diff_attention=p["diff_attention"],
        untie_embeddings=untie,
    )


@pytest.mark.parametrize("name,size", sorted(PAPER_SIZES.items()))
def test_scaling_sizes_match_paper_names(name, size):
    assert _count(get_preset(name), untie=False) == pytest.approx(size, rel=0.02)


def test_3b_recipe_is_the_paper_table():
    p = get_preset("diff-3b")
    assert (
        p["num_layers"],
        p["hidden_size"],
        p["ffn_hidden_size"],
        p["num_attention_heads"],
        p["kv_channels"],
    ) == (28, 3072, 8192, 12, 128)
    assert p["seq_length"] == 4096 and p["global_batch_size"] * 4096 == 4 * 2**20
    assert (p["lr"], p["min_lr"], p["lr_warmup_iters"], p["lr_decay_style"]) == (
        3.2e-4,
        1.28e-5,
        1000,
        "linear",
    )
    assert (p["adam_beta1"], p["adam_beta2"], p["weight_decay"]) == (0.9, 0.95, 0.1)
    assert p["train_iters"] * 1024 * 4096 >= 1e12 > (p["train_iters"] - 1) * 1024 * 4096
    assert p["vocab_size"] == 100288
    # 3.17B non-embedding + 0.31B embedding (3.48B counted as the paper counts; 3.79B untied)
    assert _count(p, untie=False) == pytest.approx(3.48e9, rel=0.01)


def test_baselines_are_flop_matched():
    for name, p in PRESETS.items():
        if not name.startswith("diff-"):
            continue
        t = PRESETS["transformer-" + name[len("diff-") :]]
        assert t["num_attention_heads"] == 2 * p["num_attention_heads"]
        assert t["kv_channels"] == p["kv_channels"] and not t["diff_attention"]
        # identical but for the 6d lambda/head-norm parameters per layer
        assert _count(p) - _count(t) == p["num_layers"] * 6 * p["kv_channels"]


def test_scaling_schedule():
    for size, lr in (("830m", 1.5e-4), ("1.4b", 1.5e-4), ("2.8b", 1.5e-4), ("6.8b", 7.5e-5), ("13b", 7.5e-5)):
        p = get_preset(f"diff-{size}")
        assert (p["train_iters"], p["lr_warmup_iters"], p["lr"], p["seq_length"]) == (40000, 375, lr, 2048)
        assert p["global_batch_size"] * 2048 == 2**18 and (p["adam_beta2"], p["weight_decay"]) == (0.98, 0.05)
        assert p["ffn_hidden_size"] == swiglu_ffn_size(p["hidden_size"])


@pytest.mark.parametrize(
    "heads,kv_heads,kind",
    [
        (2, 1, {}),
        (4, 2, {"diff_attention": False}),
        (4, 4, {"diff_version": 2}),
        (4, 2, {"diff_version": 2}),
        (4, 2, {"diff_version": 2, "untie_embeddings": False}),
    ],
    ids=["diff", "transformer", "diff2", "diff2-gqa", "diff2-tied"],
)
def test_count_matches_built_model(single_rank_parallel_state, heads, kv_heads, kind):
    """Hidden 64; heads as on the command line: DIFF 2 (4 sub-heads), baseline 4, DIFF V2 4 (8 queries);
    tied: the embedding is the output layer, counted once (128 x 64 fewer)."""
    from diffmeg.model import build_model

    baseline = kind.get("diff_attention") is False  # tiny_config counts it as DIFF: 2h heads of d
    h, g = (heads // 2, kv_heads // 2) if baseline else (heads, kv_heads)
    tied = kind.get("untie_embeddings") is False
    fields = {k: v for k, v in kind.items() if k != "untie_embeddings"}
    cfg = tiny_config(h, g, 16, layers=2, ffn=96, share_embeddings_and_output_weights=tied, **fields)
    model = build_model(cfg, vocab_size=128, max_sequence_length=16)
    built = sum(p.numel() for p in model.parameters())
    assert built == count_parameters(2, 64, 96, 128, heads, 16, kv_heads, **kind)
    if tied:
        assert built == count_parameters(2, 64, 96, 128, heads, 16, kv_heads, **fields) - 128 * 64
    assert isinstance(next(model.parameters()), torch.Tensor)


def test_diff2_presets_share_the_transformer_sizes():
    """diff2-SIZE: the layers, hidden and FFN of diff-SIZE and transformer-SIZE, the Transformer's heads."""
    for size in ("tiny", "830m", "1.4b", "2.8b", "6.8b", "13b", "3b", "3b-64k"):
        v2, base, v1 = (
            get_preset(f"diff2-{size}"),
            get_preset(f"transformer-{size}"),
            get_preset(f"diff-{size}"),
        )
        assert v2["diff_attention"] is True and v2["diff_version"] == 2
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "lr", "global_batch_size"):
            assert v2[key] == base[key] == v1[key], (size, key)
        assert (v2["num_attention_heads"], v2["kv_channels"]) == (
            base["num_attention_heads"],
            base["kv_channels"],
        )
    p = get_preset("diff2-3b")
    assert (p["num_attention_heads"], p["kv_channels"]) == (24, 128)
    n = count_parameters(28, 3072, 8192, 100288, 24, 128, None, diff_attention=True, diff_version=2)
    assert n == 4_053_543_936  # issue 13: 48 query heads, 24 KV heads, lambda_proj, untied output
