"""DiffTransformerConfig validation: each impossible layout is one clear DiffmegError; the parameter count
matches the built model."""

from __future__ import annotations

import dataclasses

import pytest

from diffmeg.config import count_parameters, lambda_init_for_layer
from diffmeg.errors import DiffmegError
from diffmeg.run_config import ModelConfig
from tests.builders import tiny_config


def cfg(**kw):
    """8 sub-heads of 8 over 2 layers; megatron-core fills in the KV groups and the FFN width unless given."""
    return tiny_config(4, None, 8, layers=2, ffn=None, **kw)


def test_valid_config_properties():
    c = cfg(num_query_groups=4)
    assert c.num_diff_heads == 4 and c.num_diff_kv_heads == 2
    assert c.lambda_init_at(1) == pytest.approx(0.2)
    assert c.lambda_init_at(3) == pytest.approx(lambda_init_for_layer(2))
    assert cfg(lambda_init="0.8").lambda_init_at(5) == 0.8


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_attention_heads=7, kv_channels=8), "even number of sub-heads"),
        (dict(tensor_model_parallel_size=8), "cannot be split over tensor-model-parallel-size 8"),
        (dict(num_query_groups=6), "divide"),
        (dict(lambda_init="bogus"), "lambda_init must be"),
        (dict(lambda_init=1.0), r"\[0, 1\)"),
        (dict(diff_attn_backend="magic"), "unknown differential attention backend"),
        (
            dict(context_parallel_size=8),
            "context-parallel-size 8 with --cp-comm-type ulysses shards whole differential heads",
        ),
    ],
)
def test_invalid_configs(kw, match):
    with pytest.raises(DiffmegError, match=match):
        cfg(**kw)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    "fields,match",
    [
        # 4 signal heads (8 + n query heads with n noise heads)
        (dict(num_attention_heads=7, num_noise_heads=3), "num_noise_heads=3 must divide the 4 signal heads"),
        (dict(num_attention_heads=5, num_noise_heads=0), "num_noise_heads=0 must divide"),
        (
            dict(num_attention_heads=6, num_noise_heads=2, num_query_groups=8),
            "2 noise heads are not a multiple",
        ),
        (
            dict(num_attention_heads=5, num_noise_heads=1, num_query_groups=2, tensor_model_parallel_size=2),
            "1 noise heads cannot be split over tensor-model-parallel-size 2",
        ),
    ],
)
def test_invalid_grouped_configs(version, fields, match):
    """Grouped differential attention: h a multiple of n, n of the KV heads and of TP, in one line each."""
    if version == 2 and "num_query_groups" in fields:  # V2 counts KV heads, V1 K1/K2 sub-groups (2 a head)
        fields = {**fields, "num_query_groups": fields["num_query_groups"] // 2}
    with pytest.raises(DiffmegError, match=match):
        cfg(diff_version=version, **fields)


@pytest.mark.parametrize("version", [1, 2])
def test_grouped_config_counts_its_heads(version):
    """4 signal heads over 1 noise head: 5 query heads; without KV heads given, one per noise head."""
    c = cfg(num_attention_heads=5, num_noise_heads=1, diff_version=version)
    assert (c.num_diff_heads, c.noise_heads, c.noise_ratio) == (4, 1, 4)
    assert c.num_query_groups == (2 if version == 1 else 1)
    classic = cfg(diff_version=version)
    assert (classic.num_diff_heads, classic.noise_heads, classic.noise_ratio) == (4, 4, 1)


def test_kv_pairs_must_stay_on_one_rank():
    # 4 DIFF heads, 1 KV head (2 sub-groups): TP=2 would split K1 from K2.
    with pytest.raises(DiffmegError, match="whole K1/K2 pairs"):
        cfg(num_query_groups=2, tensor_model_parallel_size=2)


def test_baseline_skips_diff_validation():
    # What DIFF rejects (odd sub-heads, its own fields' bad values) builds the baseline, through
    # megatron-core's own post-init (which fills in the GQA groups and the FFN width).
    odd = dict(num_attention_heads=7, kv_channels=8, hidden_size=56, lambda_init="bogus")
    with pytest.raises(DiffmegError, match="even number of sub-heads"):
        cfg(**odd)
    c = cfg(diff_attention=False, diff_attn_backend="magic", **odd)
    assert (c.num_query_groups, c.ffn_hidden_size, c.lambda_init) == (7, 4 * 56, "bogus")


@pytest.mark.parametrize(
    "heads,kv_heads,kind",
    [
        (2, 1, {}),
        (4, 2, {"diff_attention": False}),
        (4, 4, {"diff_version": 2}),
        (4, 2, {"diff_version": 2}),
        (4, 2, {"diff_version": 2, "tied": True}),
        (2, 1, {"num_noise_heads": 1}),
        (4, 2, {"diff_version": 2, "num_noise_heads": 2}),
        (4, 1, {"diff_version": 2, "num_noise_heads": 1}),
        (2, 1, {"num_noise_heads": 1, "mlp_activation": "poly_norm"}),
    ],
    ids=[
        *("diff", "transformer", "diff2", "diff2-gqa", "diff2-tied"),
        *("gda-v1", "gda-v2", "gda-v2-4to1", "motif"),
    ],
)
def test_count_matches_built_model(single_rank_parallel_state, heads, kv_heads, kind):
    """Hidden 64; heads as on the command line: DIFF 2 (4 sub-heads), baseline 4, DIFF V2 4 (8 queries);
    tied: the embedding is the output layer, counted once (128 x 64 fewer)."""
    from diffmeg.model import build_model

    baseline = kind.get("diff_attention") is False  # tiny_config counts it as DIFF: 2h heads of d
    h, g = (heads // 2, kv_heads // 2) if baseline else (heads, kv_heads)
    tied, noise = kind.get("tied", False), kind.get("num_noise_heads")
    fields = {k: v for k, v in kind.items() if k not in ("tied", "num_noise_heads")}
    cfg = tiny_config(
        h, g, 16, layers=2, ffn=96, noise=noise, share_embeddings_and_output_weights=tied, **fields
    )
    model = build_model(cfg, vocab_size=128, max_sequence_length=16)
    built = sum(p.numel() for p in model.parameters())
    sizes = ModelConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=16,
        seq_length=16,
        max_position_embeddings=16,
        vocab_size=128,
        tie_embeddings_and_output_weights=tied,
        num_noise_heads=noise,
        **fields,
    )
    assert built == count_parameters(sizes)
    if tied:
        untied = dataclasses.replace(sizes, tie_embeddings_and_output_weights=False)
        assert built == count_parameters(untied) - 128 * 64
    # one rank's share: the whole model on one rank; a tied model's last pipeline stage holds the embedding
    assert count_parameters(sizes, 1, 1) == count_parameters(sizes)
    untied = dataclasses.replace(sizes, tie_embeddings_and_output_weights=False)
    assert count_parameters(sizes, 1, 2) == count_parameters(untied, 1, 2)
