"""DiffTransformerConfig validation: each impossible layout is one clear DiffmegError."""

from __future__ import annotations

import pytest

from diffmeg.config import lambda_init_for_layer
from diffmeg.errors import DiffmegError
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
