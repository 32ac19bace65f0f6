"""The pure mapping and config functions: exact inverses, the math preserved, bad layouts refused.

The math check runs in float64 against two independent references: tests/reference_model.py (the paper's
equations on megatron-core's layout) and `diffllama_logits` below, written from transformers'
`DiffLlamaAttention` (2h query heads, head i paired with i + h, value halves j and j + g, weightless head
norm). The real transformers model is compared in tests/tools/test_convert_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from diffmeg.conversion.hf_config import hf_config_dict, layout_from_args, layout_from_hf_config
from diffmeg.conversion.layout import DiffLayout
from diffmeg.conversion.mapping import fuse_qkv, hf_to_mcore, mcore_layer_to_hf, mcore_to_hf, split_fused_qkv
from diffmeg.errors import DiffmegError
from tests.conversion import layouts
from tests.conversion.layouts import flatten, hf_config, random_mcore
from tests.reference_model import reference_logits, rmsnorm, semantic_weights_from_mcore

LAYOUTS = {  # (h DIFF heads, g DIFF KV heads): MHA, GQA r=2, MQA, odd r (pairs straddle query groups)
    "mha": (4, 4),
    "gqa": (4, 2),
    "mqa": (4, 1),
    "gqa-odd": (3, 3),
}


def make_layout(h: int, g: int, layers: int = 2) -> DiffLayout:
    return layouts.tiny_layout(
        DiffLayout, h, g, layers, hidden_size=24, ffn_hidden_size=40, head_dim=6, norm_eps=1e-5
    )


def diffllama_logits(tokens: torch.Tensor, sd: dict, config: dict) -> torch.Tensor:
    """float64 logits of a DiffLlama state dict, following transformers' DiffLlamaAttention step by step."""
    eps, d = config["rms_norm_eps"], config["head_dim"]

    def attention(q, k, v, p, li):  # q [s, 2h, d], k and v [s, 2g, d]
        v1, v2 = v.chunk(2, dim=1)  # value heads [0, g) and [g, 2g), each repeated over both halves
        v1, v2 = torch.cat([v1, v1], 1), torch.cat([v2, v2], 1)
        o = torch.stack(
            [torch.cat([a @ v1[:, kv], a @ v2[:, kv]], -1) for a, kv in layouts.causal_maps(q, k)], 1
        )
        o1, o2 = o.chunk(2, dim=1)  # heads [0, h) and [h, 2h) of o [s, 2h, 2d]
        lam_init = 0.8 - 0.6 * math.exp(-0.3 * li)
        lam = (
            torch.exp((sd[p + "self_attn.lambda_q1"] * sd[p + "self_attn.lambda_k1"]).sum())
            - torch.exp((sd[p + "self_attn.lambda_q2"] * sd[p + "self_attn.lambda_k2"]).sum())
            + lam_init
        )
        o = (1 - lam_init) * rmsnorm(o1 - lam * o2, torch.ones(2 * d, dtype=o.dtype), eps)  # [s, h, 2d]
        return o.reshape(q.shape[0], -1)

    return layouts.llama_family_logits(tokens, sd, config, attention)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qkv_split_and_fuse_are_inverse_and_match_the_reference_layout(name):
    h, g = LAYOUTS[name]
    layout = make_layout(h, g)
    sd = random_mcore(layout)
    qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = split_fused_qkv(qkv, layout)
    assert torch.equal(fuse_qkv(q, k, v, layout), qkv)
    # DiffLlama head i / i + h are Q1 / Q2 of DIFF head i, KV heads j / j + g are K1 / K2 and the V halves.
    cfg = {"heads": h, "kv_heads": g, "head_dim": layout.head_dim, "layers": layout.num_layers}
    sem = semantic_weights_from_mcore(sd, cfg)["layers"][0]
    d, hidden = layout.head_dim, layout.hidden_size
    q, k, v = q.view(2 * h, d, hidden), k.view(2 * g, d, hidden), v.view(2 * g, d, hidden)
    assert torch.equal(q[:h], sem["wq1"]) and torch.equal(q[h:], sem["wq2"])
    assert torch.equal(k[:g], sem["wk1"]) and torch.equal(k[g:], sem["wk2"])
    assert torch.equal(torch.cat([v[:g], v[g:]], dim=1), sem["wv"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mapping_preserves_the_model_in_float64(name):
    h, g = LAYOUTS[name]
    layout = make_layout(h, g)
    sd = random_mcore(layout, seed=1)
    hf = flatten(mcore_to_hf(sd, layout))
    config = hf_config_dict(layout, dtype="float64", bos_token_id=None, eos_token_id=None)
    tokens = torch.randint(0, layout.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    cfg = {"heads": h, "kv_heads": g, "head_dim": layout.head_dim, "layers": layout.num_layers}
    cfg["rotary_base"] = layout.rotary_base
    ours = reference_logits(tokens, semantic_weights_from_mcore(sd, cfg), cfg)
    theirs = diffllama_logits(tokens, hf, config)
    torch.testing.assert_close(theirs, ours, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_to_mcore_to_hf_is_identical(dtype):
    layout = make_layout(4, 2)
    hf = flatten(mcore_to_hf(random_mcore(layout, seed=3), layout, dtype))
    back = flatten(mcore_to_hf(flatten(hf_to_mcore(hf, layout)), layout))
    assert back.keys() == hf.keys()
    for key in hf:
        assert back[key].dtype == dtype and torch.equal(back[key], hf[key]), key


def test_a_tied_model_maps_without_an_output_layer_both_ways():
    """Tied: no output_layer / lm_head in either format, HF -> mcore -> HF is exact, and a stored lm_head is
    not read (transformers ties it to the embedding); an untied layout needs its lm_head."""
    layout = dataclasses.replace(make_layout(2, 2, layers=1), tied=True)
    sd = random_mcore(layout, seed=5)
    assert "output_layer.weight" not in sd
    hf = flatten(mcore_to_hf(sd, layout))
    assert "lm_head.weight" not in hf and "model.embed_tokens.weight" in hf
    mcore = flatten(hf_to_mcore({**hf, "lm_head.weight": torch.zeros(50, 24)}, layout))
    assert "output_layer.weight" not in mcore
    back = flatten(mcore_to_hf(mcore, layout))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())
    with pytest.raises(DiffmegError, match="'lm_head.weight' is missing"):
        flatten(hf_to_mcore(hf, dataclasses.replace(layout, tied=False)))


def test_mcore_to_hf_to_mcore_folds_the_head_norm():
    layout = make_layout(2, 1, layers=1)
    sd = random_mcore(layout, seed=4)
    back = flatten(hf_to_mcore(flatten(mcore_to_hf(sd, layout)), layout))
    norm = sd["decoder.layers.0.self_attention.core_attention.head_norm.weight"]
    for key, value in sd.items():
        if key.endswith("head_norm.weight"):
            assert torch.equal(back[key], torch.ones_like(value))
        elif key.endswith("linear_proj.weight"):  # head i's 2d input columns scaled by the norm weight
            torch.testing.assert_close(back[key], value * norm.repeat(layout.num_heads), rtol=0, atol=0)
        else:
            assert torch.equal(back[key], value), key


def test_views_are_exported_exactly(tmp_path):
    """Outputs are not copied (gate/up are views of fc1's halves, unchanged tensors are the input's): the
    shard writer stores each view's own elements, which the safetensors package reads back."""
    from safetensors.torch import load_file

    from diffmeg.conversion.safetensors_io import SafetensorsShardWriter

    layout = make_layout(2, 2, layers=1)
    layer = {k[len("decoder.layers.0.") :]: v for k, v in random_mcore(layout).items() if ".0." in k}
    out = mcore_layer_to_hf(layer, layout)
    assert (
        out["mlp.gate_proj.weight"].untyped_storage().data_ptr() == layer["mlp.linear_fc1.weight"].data_ptr()
    )
    writer = SafetensorsShardWriter(
        str(tmp_path), 10**9, [(k, tuple(v.shape), v.dtype) for k, v in out.items()]
    )
    writer.add(out)
    (name,) = writer.close()
    back = load_file(str(tmp_path / name))
    assert back.keys() == out.keys() and all(torch.equal(back[k], v) for k, v in out.items())


def test_shape_mismatch_is_refused():
    layout = make_layout(4, 2)
    sd = random_mcore(layout)
    sd["decoder.layers.1.mlp.linear_fc1.weight"] = sd["decoder.layers.1.mlp.linear_fc1.weight"][:-2]
    with pytest.raises(DiffmegError, match="shape mismatch for 'mlp.linear_fc1.weight'"):
        flatten(mcore_to_hf(sd, layout))
    del sd["output_layer.weight"]
    with pytest.raises(DiffmegError, match="'output_layer.weight' is missing"):
        flatten(mcore_to_hf(sd, layout))


def test_layout_from_args_round_trips_through_pretrain_flags():
    layout = make_layout(4, 2)
    assert layout_from_args(layouts.layout_args(layout)) == layout
    assert layout_from_args(layouts.pretrain_args(layout)) == layout


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lambda_init": 0.8}, "cannot express a constant lambda_init"),
        ({"lambda_init": "0.5"}, "cannot express a constant lambda_init"),
        ({"norm_epsilon": 1e-6}, "one epsilon for every RMSNorm"),
        ({"head_norm_eps": 1e-6}, "one epsilon for every RMSNorm"),
    ],
)
def test_layouts_diffllama_cannot_express_are_refused(overrides, message):
    with pytest.raises(DiffmegError, match=message):
        layout_from_args(layouts.layout_args(make_layout(4, 2), **overrides))


def test_layout_from_hf_config_inverts_hf_config_dict():
    assert layout_from_hf_config(hf_config(make_layout(4, 2))) == make_layout(4, 2)
    legacy = hf_config(make_layout(4, 2), rope_parameters=None, rope_theta=500.0, tie_word_embeddings=True)
    assert layout_from_hf_config(legacy) == dataclasses.replace(make_layout(4, 2), tied=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        *layouts.REFUSED_BY_EVERY_LAYOUT,
        ({"num_attention_heads": 7}, "must be even"),
        ({"num_key_value_heads": 3}, "must be even"),
        ({"rms_norm_eps": 1e-6}, "head-norm epsilon"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "scaled RoPE"),
        ({"num_key_value_heads": 6}, "do not divide"),
    ],
)
def test_hf_configs_our_model_cannot_express_are_refused(overrides, message):
    with pytest.raises(DiffmegError, match=message):
        layout_from_hf_config(hf_config(make_layout(4, 2), **overrides))


def test_checkpoint_keys_match_megatron_core(single_rank_parallel_state):
    """The reader's key table is what megatron-core's sharded state dict of our model uses."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from diffmeg.checkpoints import build_single_rank_model
    from diffmeg.conversion.checkpoint_io import checkpoint_key

    layout = make_layout(4, 2)
    model = build_single_rank_model(layouts.pretrain_args(layout))
    sharded = model.sharded_state_dict()
    for local, shape in layout.mcore_layer_shapes().items():
        entry = sharded[f"decoder.layers.1.{local}"]
        assert entry.key == checkpoint_key(local)
        if isinstance(entry, ShardedTensor):  # fc1 is a factory (gate and up sharded separately)
            assert tuple(entry.global_shape) == (layout.num_layers, *shape) and entry.global_offset[0] == 1
    for key, shape in layout.mcore_global_shapes().items():
        assert sharded[key].key == key and tuple(sharded[key].global_shape) == shape


@pytest.mark.parametrize("heads, kv_heads, noise", [(4, 2, None), (8, 2, 2), (3, 3, None), (6, 2, 2)])
def test_motif_layer_maps_both_ways_exactly_and_deals_heads_over_the_subgroups(heads, kv_heads, noise):
    """Motif's HF layer -> megatron-core -> back is the identity; K/V sub-group m of the fused QKV holds
    Motif's query heads `query_heads_per_subgroup` deals it, then key and value sub-heads m."""
    from diffmeg.config import query_heads_per_subgroup
    from diffmeg.conversion.layout import MotifLayout
    from diffmeg.conversion.mapping import hf_layer_to_mcore

    layout = layouts.tiny_layout(
        MotifLayout, heads, kv_heads, 1, hidden_size=24, ffn_hidden_size=40, head_dim=6, norm_eps=1e-6
    )
    layout = dataclasses.replace(layout, num_noise_heads=noise)
    gen = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(shape, generator=gen) for k, shape in layout.hf_layer_shapes().items()}
    mcore = hf_layer_to_mcore(hf, layout)
    assert torch.equal(mcore["self_attention.core_attention.head_norm.weight"], hf["self_attn.subln.weight"])
    assert torch.equal(mcore["mlp.poly_norm.weight"], hf["mlp.act_fn.weight"])
    back = mcore_layer_to_hf(mcore, layout)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    d = layout.head_dim
    rows = mcore["self_attention.linear_qkv.weight"].view(-1, d, 24)
    q, k, v = (hf[f"self_attn.{n}_proj.weight"].view(-1, d, 24) for n in "qkv")
    start, row = 0, 0
    for m, count in enumerate(query_heads_per_subgroup(layout.query_heads, 2 * layout.num_kv_heads)):
        assert torch.equal(rows[row : row + count], q[start : start + count])
        assert torch.equal(rows[row + count], k[m]) and torch.equal(rows[row + count + 1], v[m])
        start, row = start + count, row + count + 2
    assert row == rows.shape[0] and start == q.shape[0]
