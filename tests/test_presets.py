"""Presets reproduce DESIGN.md's table (their sizes counted by `diffmeg.config.count_parameters`)."""

from __future__ import annotations

import dataclasses

import pytest

from diffmeg.config import count_parameters
from diffmeg.presets import PRESETS, get_preset, swiglu_ffn_size
from diffmeg.run_config import ModelConfig

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
    """The parameters of preset `p`'s model; `untie` False: the embedding counted once."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    sizes = {k: v for k, v in p.items() if k in names}
    sizes.setdefault("num_query_groups", p["num_attention_heads"])
    return count_parameters(ModelConfig(**sizes, tie_embeddings_and_output_weights=not untie))


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
    n = _count(p)
    assert n == 4_053_543_936  # issue 13: 48 query heads, 24 KV heads, lambda_proj, untied output


def test_gda_presets_are_diff2_with_a_quarter_as_many_noise_and_kv_heads():
    """Motif-3's V2-style GDA at 4:1, one KV head per group of signal heads and their noise head."""
    for name in PRESETS:
        if name.startswith("gda-"):
            gda, v2 = get_preset(name), get_preset(name.replace("gda-", "diff2-"))
            groups = v2["num_attention_heads"] // 4
            assert gda == {**v2, "num_noise_heads": groups, "num_query_groups": groups}, name


def test_readme_gda_parameter_table_is_the_formulas():
    """README's table of transformer-* / diff2-* / gda-* parameters and the GDA core's FLOPs against V2's is
    what count_parameters and forward_flops_per_token give."""
    import re

    from diffmeg.training.flops import forward_flops_per_token
    from tests.conftest import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Grouped differential attention") :]
    rows = re.findall(r"^\| (\w[\w.]*) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \|$", section, re.M)
    assert [r[0] for r in rows] == ["tiny", "830m", "1.4b", "2.8b", "3b", "6.8b", "13b"]

    def core(p):
        sizes = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels")
        f = forward_flops_per_token(
            **{k: p[k] for k in sizes},
            num_query_groups=p.get("num_query_groups") or p["num_attention_heads"],
            seq_length=p["seq_length"],
            vocab_size=p["vocab_size"],
            diff_attention=True,
            diff_version=2,
            num_noise_heads=p.get("num_noise_heads"),
        )
        return f.attention_core

    for size, *counts, ratio in rows:
        names = [f"{arch}-{size}" for arch in ("transformer", "diff2", "gda")]
        assert [int(c.replace(",", "")) for c in counts] == [_count(get_preset(n)) for n in names], size
        gda, v2 = get_preset(names[2]), get_preset(names[1])
        assert float(ratio) == pytest.approx(core(gda) / core(v2), abs=5e-4), size


# Motif's config.json keys for the published checkpoints, as diffmeg/presets.py sources them (the values it
# marks unconfirmed are the same here: this checks that the preset is what an import of such a folder
# records, not the values themselves).
MOTIF_CONFIGS = {
    "motif-2.6b": {
        "model_type": "motif",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 219520,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "poly_norm",
    },
    "motif-12.7b": {
        "model_type": "motif",
        "hidden_size": 4096,
        "intermediate_size": 16384,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 16,
        "num_noise_heads": 8,
        "head_dim": 128,
        "k_ratio": 1,
        "vocab_size": 219520,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "poly_norm",
    },
}
MOTIF_SIZES = {"motif-2.6b": 2.6e9, "motif-12.7b": 12.7e9}


@pytest.mark.parametrize("name", sorted(MOTIF_CONFIGS))
def test_motif_presets_are_what_an_import_of_the_published_config_records(name):
    """`--model motif-*` resolves to the arguments hf-to-mcore's continue-training flags give for a folder
    with the published config.json: the same shape (PolyNorm, Motif's lambda_init, the noise heads of the
    12.7B layout), rotary base, epsilon and ties."""
    from diffmeg.conversion.hf_config import layout_from_hf_config, pretrain_flags
    from diffmeg.run_config import SHAPE_FIELDS
    from diffmeg.training.arguments import resolve_args

    common = ["--mock-data", "--seq-length", "4096", "--lr", "3e-5", "--train-iters", "10"]
    imported = resolve_args(
        [*pretrain_flags(layout_from_hf_config(MOTIF_CONFIGS[name])), *common], world_size=1
    )
    preset = resolve_args(["--model", name, *common], world_size=1)
    fields = (
        *SHAPE_FIELDS,
        "rotary_base",
        "norm_epsilon",
        "lambda_init",
        "tie_embeddings_and_output_weights",
    )
    assert {f: getattr(preset, f) for f in fields} == {f: getattr(imported, f) for f in fields}
    assert (preset.mlp_activation, str(preset.lambda_init)) == ("poly_norm", "motif")
    assert preset.num_noise_heads == imported.num_noise_heads
    # 12.7B: GDA, 8 groups of [signal x 4, noise]; 2.6B: each head its own noise head (plain DIFF)
    assert preset.num_attention_heads // preset.num_noise_heads == (4 if name == "motif-12.7b" else 1)


@pytest.mark.parametrize("name,size", sorted(MOTIF_SIZES.items()))
def test_motif_presets_have_the_published_sizes(name, size):
    """Counted as the preset builds the model (2.6B's embedding tied, 12.7B's output layer its own)."""
    p = get_preset(name)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in p.items() if k in names})
    assert count_parameters(model) == pytest.approx(size, rel=0.01)
