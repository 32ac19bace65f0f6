"""mcore-to-hf of a Motif import back to Motif's format: tiny Motif folders of both layouts (made by
test_motif_import.py's `write_motif_folder`) through hf-to-mcore and back give the folder's tensors (names,
shapes, dtypes, bytes) and config.json (keys that only matter when enabled included); transformers loads
the export with diffmeg's own remote code (configuration_motif.py, modeling_motif.py), its float64 logits
are the float64 forward written from Motif's format, and its `generate`, with the KV cache and without,
continues every prompt as tools/generate.py's function does on the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conversion.helpers import (
    cached,
    convert_ok,
    hf_outputs,
    max_relative_error,
    our_logits,
    read_safetensors_folder,
    roundtrip_prompts,
)
from tests.conversion.test_motif_import import BASE, LAYOUTS, VOCAB, motif_logits, write_motif_folder

NEW_TOKENS = 8
FP32_IN, BF16_OUT = ["--dtype", "fp32"], ["--dtype", "bf16"]
ROUND_TRIPS = {  # name: (layout, bf16 weights beside fp32 lambdas, hf-to-mcore flags, mcore-to-hf flags)
    "2.6b": ("2.6b", False, [], []),
    "12.7b": ("12.7b", False, [], []),
    # recorded for TP=2 / PP=3 (layout-free: the same files); exported back in bf16, the lambdas in fp32
    "12.7b-bf16-tp2": ("12.7b", True, [*FP32_IN, "--tensor-model-parallel-size", "2"], BF16_OUT),
    "2.6b-bf16-pp3": ("2.6b", True, [*FP32_IN, "--pipeline-model-parallel-size", "3"], BF16_OUT),
}


def _round_trip(factory, name: str) -> tuple[Path, Path, Path]:
    """(Motif folder, its import, the import's export), built once per session."""
    layout, bf16, import_flags, export_flags = ROUND_TRIPS[name]
    source = cached(factory, f"motif-export-src-{name}", lambda p: write_motif_folder(p, layout, bf16=bf16))
    ckpt = cached(
        factory,
        f"motif-export-ckpt-{name}",
        lambda p: convert_ok("hf-to-mcore", "--load", source, "--save", p, *import_flags),
    )
    folder = cached(
        factory,
        f"motif-export-hf-{name}",
        lambda p: convert_ok("mcore-to-hf", "--load", ckpt, "--save", p, *export_flags),
    )
    return source, ckpt, folder


@pytest.mark.parametrize("name", list(ROUND_TRIPS))
def test_motif_import_then_export_is_bit_exact(tmp_path_factory, name):
    """Every tensor comes back under its name with its shape, dtype and bytes (bf16 weights beside fp32
    lambda vectors too), config.json with every key and value (`sliding_window` beside
    `use_sliding_window: false`, `auto_map`, the sub-head counts, `num_noise_heads`), the tokenizer's files,
    and the remote code beside them."""
    source, _, folder = _round_trip(tmp_path_factory, name)
    theirs, ours = read_safetensors_folder(source), read_safetensors_folder(folder)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert (ours[key].dtype, ours[key].shape) == (value.dtype, value.shape), key
        assert torch.equal(ours[key].view(torch.uint8), value.view(torch.uint8)), key
    if ROUND_TRIPS[name][1]:
        assert ours["model.layers.0.self_attn.lambda_q1"].dtype == torch.float32
        assert ours["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    config = json.loads((folder / "config.json").read_text())
    assert config == json.loads((source / "config.json").read_text())
    assert list(config) == list(json.loads((source / "config.json").read_text()))  # and in its order
    assert config["sliding_window"] == 16 and config["use_sliding_window"] is False
    for file in ("tokenizer.json", "configuration_motif.py", "modeling_motif.py", "generation_config.json"):
        assert (folder / file).is_file(), file
    assert (folder / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_without_an_imported_config_the_export_writes_motifs_keys(layout):
    """A checkpoint that was not imported (no recorded config.json: a continued run's) gets Motif's key set
    with the model's values, which reads back as the same layout; a sparse source config gets no key Motif's
    defaults already give, and its own values (an int rope_theta) stay as they were."""
    from diffmeg.conversion.hf_config import MOTIF_AUTO_MAP, layout_from_hf_config, motif_config_dict

    motif = layout_from_hf_config({**BASE, **LAYOUTS[layout]})
    config = motif_config_dict(motif, dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    assert config["model_type"] == "motif" and config["architectures"] == ["MotifForCausalLM"]
    assert config["auto_map"] == MOTIF_AUTO_MAP and config["hidden_act"] == "poly_norm"
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (
        (LAYOUTS[layout]["num_attention_heads"], LAYOUTS[layout]["num_key_value_heads"])
    )
    assert config.get("num_noise_heads") == LAYOUTS[layout].get("num_noise_heads")
    assert config["attn_rms_norm_eps"] == 1e-5 and config["use_sliding_window"] is False
    assert config["torch_dtype"] == "bfloat16" and "sliding_window" not in config
    assert layout_from_hf_config(config) == motif

    sparse = {k: v for k, v in {**BASE, **LAYOUTS[layout]}.items() if k not in ("k_ratio", "use_bias")}
    sparse["rope_theta"] = 5000
    again = motif_config_dict(motif, dtype="float32", bos_token_id=None, eos_token_id=None, source=sparse)
    assert again == sparse and isinstance(again["rope_theta"], int)


@pytest.mark.hf_export
@pytest.mark.parametrize("name", ["2.6b", "12.7b"])
def test_transformers_runs_the_export_as_motifs_forward_and_generates_our_tokens(
    tmp_path_factory, tmp_path, single_rank_parallel_state, name
):
    """AutoModelForCausalLM with trust_remote_code builds diffmeg's MotifForCausalLM from the export; in
    float64 its logits are the float64 forward written from Motif's format on the folder's tensors; in fp32
    they are the imported checkpoint's, and greedy `generate` (KV cache on and off; past the folder's
    `sliding_window` of 16, which is off) gives tools/generate.py's tokens."""
    from diffmeg.generation import SamplingConfig, generate
    from tests.builders import load_model

    source, ckpt, folder = _round_trip(tmp_path_factory, name)
    config = json.loads((source / "config.json").read_text())
    tensors = read_safetensors_folder(source)
    prompts = roundtrip_prompts(VOCAB)
    wide = hf_outputs(tmp_path / "f64", folder, prompts, dtype="float64")
    assert wide["class"] == "MotifForCausalLM"
    for ids, theirs in zip(prompts, wide["logits"], strict=True):
        err = max_relative_error(theirs, motif_logits(tensors, config, ids))
        print(f"{name}: float64 max relative error {err:.2e} ({ids.numel()} tokens)")
        assert err < 1e-12, (ids.numel(), err)

    reference = hf_outputs(tmp_path / "f32", folder, prompts, NEW_TOKENS)
    assert reference["generated"] == reference["generated_nocache"], reference["transformers"]
    model, _ = load_model(str(ckpt))
    for ids, theirs, continued in zip(prompts, reference["logits"], reference["generated"], strict=True):
        assert max_relative_error(our_logits(model, ids), theirs) < 1e-5, ids.numel()
        ours = generate(model, ids.tolist(), NEW_TOKENS, SamplingConfig(greedy=True))
        assert ours.output_ids == continued[: len(ours.output_ids)], ids.numel()


@pytest.mark.slow
def test_a_checkpoint_saved_at_tp2_exports_the_folders_tensors(tmp_path_factory, tmp_path):
    """The 12.7B-layout import continued for one step at TP=2 with a zero learning rate (the weights stay
    what they were) and saved by that run (every tensor written split over two ranks, the groups of
    [signal x 4, noise] one a rank): its export is the folder's tensors bit for bit, and its config.json,
    from a checkpoint that records no imported config, Motif's keys with the same model."""
    import subprocess

    from diffmeg.conversion.hf_config import layout_from_hf_config
    from tests.distributed.runner import REPO_ROOT, job_env, launch_cmd

    source, ckpt, _ = _round_trip(tmp_path_factory, "12.7b")
    run = tmp_path / "run"
    flags = ["--use-checkpoint-args", "--load", str(ckpt), "--finetune", "--save", str(run)]
    flags += ["--lr", "0.0", "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "1"]
    flags += ["--tensor-model-parallel-size", "2", "--save-interval", "1"]
    proc = subprocess.run(
        launch_cmd(2, ["pretrain_diff.py", *flags]),
        cwd=REPO_ROOT,
        env=job_env(tmp_path, 2),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    convert_ok("mcore-to-hf", "--load", run, "--save", tmp_path / "hf")
    theirs, ours = read_safetensors_folder(source), read_safetensors_folder(tmp_path / "hf")
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "sliding_window" not in config  # not recorded by the continued run: Motif's key set only
    assert layout_from_hf_config(config) == layout_from_hf_config(
        json.loads((source / "config.json").read_text())
    )


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window: true is not supported"),
        ({"k_ratio": 2}, "k_ratio 2 is not supported"),
        ({"use_bias": True}, "biases are not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 must be 2 x num_noise_heads"),
    ],
)
def test_the_remote_code_refuses_what_it_cannot_run(changes, message):
    """diffmeg's MotifForCausalLM builds from the 12.7B layout's config.json (a window that is off is no
    window: every layer full attention) and refuses, naming the key, what it does not implement."""
    from diffmeg.conversion.configuration_motif import MotifConfig
    from diffmeg.conversion.modeling_motif import MotifForCausalLM

    keys = {k: v for k, v in {**BASE, **LAYOUTS["12.7b"]}.items() if k not in ("auto_map", "architectures")}
    config = MotifConfig(**keys)
    assert config.layer_types == ["full_attention"] * 3 and config.sliding_window == 16
    assert MotifForCausalLM(config).model.layers[0].self_attn.num_heads == 8
    with pytest.raises(ValueError, match=message):
        MotifForCausalLM(MotifConfig(**{**keys, **changes}))
