"""DiffSelfAttention: the 1:1 DIFF models unchanged by the noise-head count, the fused QKV of any layout."""

from __future__ import annotations

import json

import pytest
import torch

from diffmeg.config import query_heads_per_subgroup
from tests.classic_snapshot import FIXTURE, MODELS, snapshot


@pytest.mark.parametrize("noise", ["default", "explicit"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_to_one_models_are_what_they_were_before_grouped_attention(
    single_rank_parallel_state, name, noise
):
    """n = h (left out, or given) builds the model the code built before GDA (tests/classic_snapshot.py):
    the same state-dict keys, shapes and initial weights, bit for bit; the same loss and gradients."""
    fields = {} if noise == "default" else {"num_noise_heads": MODELS[name]["heads"]}
    got, want = snapshot(name, **fields), json.loads(FIXTURE.read_text())[name]
    assert got["tensors"] == want["tensors"]
    assert got["loss_fp64"] == pytest.approx(want["loss_fp64"], rel=1e-12)
    assert got["loss_fp32"] == pytest.approx(want["loss_fp32"], rel=1e-6)
    assert got["grad_norms_fp64"].keys() == want["grad_norms_fp64"].keys()
    for key, value in want["grad_norms_fp64"].items():
        assert got["grad_norms_fp64"][key] == pytest.approx(value, rel=1e-10), key


def test_query_heads_per_subgroup_is_megatron_cores_where_it_divides_and_even_elsewhere():
    assert query_heads_per_subgroup(8, 4) == [2, 2, 2, 2]  # megatron-core's np / ng
    assert query_heads_per_subgroup(40, 16) == [2, 3, 2, 3] * 4  # Motif-2-12.7B's 40 over 16
    assert query_heads_per_subgroup(5, 2) == [2, 3]
    # a tensor-parallel rank of whole groups sees the same pattern on its own heads
    whole = query_heads_per_subgroup(40, 16)
    for tp in (2, 4, 8):
        assert query_heads_per_subgroup(40 // tp, 16 // tp) == whole[: 16 // tp]


def test_spread_layout_splits_the_fused_projection(single_rank_parallel_state):
    """With 6 query sub-heads over 4 K/V sub-groups the fused rows are [q q k v | q k v | q q k v | q k v]:
    query, key and value come out of the projection in that order."""
    from diffmeg.model import build_model
    from tests.builders import make_config

    cfg = make_config(4, 2, 8, noise=2)  # 4 + 2 query sub-heads over 2 x 2 sub-groups
    model = build_model(cfg, vocab_size=64, max_sequence_length=16).double()
    attention = model.decoder.layers[0].self_attention
    assert attention.query_heads_per_group == [1, 2, 1, 2]
    x = torch.randn(3, 2, 64, dtype=torch.float64)
    query, key, value = attention.get_query_key_value_tensors(x)
    rows = (x @ attention.linear_qkv.weight.T).view(3, 2, -1, 8)  # [s, b, 10 blocks, d]
    order = {"q": [0, 3, 4, 7, 10, 11], "k": [1, 5, 8, 12], "v": [2, 6, 9, 13]}
    assert rows.shape[2] == 14
    torch.testing.assert_close(query, rows[:, :, order["q"]], rtol=0, atol=0)
    torch.testing.assert_close(key, rows[:, :, order["k"]], rtol=0, atol=0)
    torch.testing.assert_close(value, rows[:, :, order["v"]], rtol=0, atol=0)
