"""benchmarks/motif_import_memory.py: the folder it writes is the motif-* preset's shape in Motif's format
(what hf-to-mcore derives from its config.json is the preset), and a small one imports with a layer's
tensors the folder's exactly."""

from __future__ import annotations

import pytest
import torch

from benchmarks.motif_import_memory import motif_config, write_folder


@pytest.mark.parametrize("size", ["12.7b", "2.6b"])
def test_the_benchmark_config_is_the_preset(size):
    from diffmeg.conversion.hf_config import layout_from_hf_config
    from diffmeg.presets import get_preset

    layout, p = layout_from_hf_config(motif_config(size, 2)), get_preset(f"motif-{size}")
    assert layout.num_layers == 2
    assert (layout.hidden_size, layout.ffn_hidden_size, layout.num_heads, layout.num_kv_heads) == (
        p["hidden_size"],
        p["ffn_hidden_size"],
        p["num_attention_heads"],
        p["num_query_groups"],
    )
    assert (layout.head_dim, layout.vocab_size, layout.rotary_base, layout.tied) == (
        p["kv_channels"],
        p["vocab_size"],
        p["rotary_base"],
        p.get("tie_embeddings_and_output_weights", False),
    )
    assert layout.num_noise_heads == p.get("num_noise_heads")


def test_a_small_benchmark_folder_imports(tmp_path, single_rank_parallel_state):
    from safetensors.torch import load_file

    from tests.builders import load_model
    from tests.conversion.helpers import convert_ok

    config = {**motif_config("12.7b", 2), "hidden_size": 64, "intermediate_size": 96, "vocab_size": 256}
    config.update(num_attention_heads=10, num_key_value_heads=4, num_noise_heads=2, head_dim=8)
    sizes = write_folder(tmp_path / "hf", config)
    convert_ok("hf-to-mcore", "--load", tmp_path / "hf", "--save", tmp_path / "ckpt", "--dtype", "fp32")
    model, args = load_model(str(tmp_path / "ckpt"))
    assert (args.num_noise_heads, args.mlp_activation, str(args.lambda_init)) == (2, "poly_norm", "motif")
    stored = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert sizes["total"] == sum(t.numel() * t.element_size() for t in stored.values())  # what it prints
    assert stored["model.layers.0.self_attn.lambda_q1"].dtype == torch.float32  # beside bf16 weights
    params = dict(model.named_parameters())
    assert torch.equal(
        params["decoder.layers.1.mlp.linear_fc2.weight"],
        stored["model.layers.1.mlp.down_proj.weight"].float(),
    )
    assert torch.equal(
        params["decoder.layers.0.self_attention.core_attention.lambda_q1"],
        stored["model.layers.0.self_attn.lambda_q1"],
    )
