"""tools/convert_checkpoint.py end to end: exports transformers loads as DiffLlamaForCausalLM with our
logits, imports that round-trip exactly and continue training, and bad input refused before writing.

transformers always runs in its own process (tests/conversion/hf_helper.py); our model runs here.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.conversion.helpers import (
    IMPORTS,
    convert,
    convert_ok,
    exported_tiny,
    imported,
    max_relative_error,
    no_leftovers,
    our_logits,
    random_hf,
    read_safetensors_folder,
    roundtrip_prompts,
    tiny_hf_reference,
    tiny_prompts,
    tool_main,
    trained_tiny,
)
from tests.conversion.helpers import refused as refused_by
from tests.data.helpers import find_bpe_file


def test_export_loads_as_diffllama_with_our_logits(tmp_path_factory, single_rank_parallel_state):
    from diffmeg.generation import load_model

    exported = exported_tiny(tmp_path_factory)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DiffLlamaForCausalLM"] and config["model_type"] == "diffllama"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 8, 32)
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # --max-shard-size 2MB: several shards
    assert (exported / "generation_config.json").exists()
    assert not (exported / "tokenizer.json").exists()  # a vocab-512 mock-data model has no cl100k tokenizer

    reference = tiny_hf_reference(tmp_path_factory)
    assert reference["class"] == "DiffLlamaForCausalLM"
    model, _ = load_model(str(trained_tiny(tmp_path_factory, "tp1")))
    for ids, theirs in zip(tiny_prompts(), reference["logits"], strict=True):
        assert max_relative_error(our_logits(model, ids), theirs) < 1e-4, ids.numel()


@pytest.mark.parametrize("name", list(IMPORTS))
def test_random_diffllama_round_trips_exactly(tmp_path_factory, single_rank_parallel_state, name):
    from diffmeg.generation import load_model

    config, _ = IMPORTS[name]
    source, ckpt = imported(tmp_path_factory, name)
    args = json.loads((ckpt / "iter_0000000" / "args.json").read_text())
    assert args["num_attention_heads"] == config["num_attention_heads"] // 2  # DIFF heads
    assert args["num_query_groups"] == config["num_key_value_heads"] // 2
    tokenizer_file = find_bpe_file()
    out = tmp_path_factory.mktemp(f"roundtrip-{name}") / "hf"
    extra = ["--tokenizer-file", tokenizer_file] if tokenizer_file else ["--no-tokenizer"]
    convert_ok("mcore-to-hf", "--load", ckpt, "--save", out, *extra)

    original, back = read_safetensors_folder(source), read_safetensors_folder(out)
    assert back.keys() == original.keys()
    for key in original:
        assert back[key].dtype == original[key].dtype and torch.equal(back[key], original[key]), key
    old, new = json.loads((source / "config.json").read_text()), json.loads((out / "config.json").read_text())
    for field in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert new[field] == old[field], field
    assert new["rope_parameters"]["rope_theta"] == old["rope_parameters"]["rope_theta"]

    # Our model, loaded from the imported checkpoint, computes transformers' logits.
    _, reference = random_hf(tmp_path_factory, f"random-{name}", config)
    assert reference["class"] == "DiffLlamaForCausalLM"
    model, _ = load_model(str(ckpt))
    for ids, theirs in zip(roundtrip_prompts(config["vocab_size"]), reference["logits"], strict=True):
        assert max_relative_error(our_logits(model, ids), theirs) < 1e-4, ids.numel()

    if config["vocab_size"] >= 100277 and tokenizer_file:
        from transformers import AutoTokenizer

        from diffmeg.data.tokenizer import load_tokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(out))
        text = "Grüße, 世界! 🙂 x = 1_000_000\n\n  done<|endoftext|>"
        assert tokenizer.encode(text) == load_tokenizer(tokenizer_file).encoding.encode(
            text, allowed_special="all"
        )
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 100257


@pytest.mark.slow
def test_imported_checkpoint_continues_training(tmp_path_factory):
    """pretrain_diff.py --load <hf-to-mcore output> starts from the imported weights (with or without
    --finetune: the import is marked weights-only, so no optimizer state is asked for)."""
    from tests.distributed.runner import read_losses, run_training

    _, ckpt = imported(tmp_path_factory, "mha")
    tmp = tmp_path_factory.mktemp("continue")
    proc = run_training(tmp, "cont", ["--load", str(ckpt), "--finetune", "--train-iters", "1"])
    assert f"loaded checkpoint from {ckpt}" in proc.stdout
    loss = read_losses(tmp, "cont")[1]
    plain = run_training(tmp, "plain", ["--load", str(ckpt), "--train-iters", "1"])
    assert f"loaded checkpoint from {ckpt} at iteration 0" in plain.stdout
    assert read_losses(tmp, "plain")[1] == loss
    # Random DiffLlama weights (std 0.05, norms up to 1.5) give a loss above a fresh init's log(512).
    assert math.isfinite(loss) and abs(loss - math.log(512)) > 0.05


# ---------------------------------------------------------------------------------- bad input


def refused(capsys, *argv) -> str:
    return refused_by(capsys, "convert_checkpoint", *argv)


def edited_checkpoint(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    args_file = next(dst.glob("iter_*")) / "args.json"
    args = json.loads(args_file.read_text())
    args.update(changes)
    args_file.write_text(json.dumps(args))
    return dst


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lambda_init": "0.5"}, "cannot express a constant lambda_init"),
        ({"norm_epsilon": 1e-6}, "one epsilon for every RMSNorm"),
        ({"diff_attention": False}, "describes the Transformer baseline"),
        ({"ffn_hidden_size": 512}, "shape mismatch for 'decoder.layers.mlp.linear_fc1.weight'"),
        ({"num_query_groups": 2}, "shape mismatch for 'decoder.layers.self_attention.linear_qkv.weight'"),
    ],
)
def test_mcore_to_hf_refuses_what_diffllama_cannot_express(
    tmp_path_factory, tmp_path, capsys, single_rank_parallel_state, changes, message
):
    ckpt = edited_checkpoint(trained_tiny(tmp_path_factory, "tp1"), tmp_path / "ckpt", **changes)
    assert message in refused(capsys, "mcore-to-hf", "--load", ckpt, "--save", tmp_path / "hf")
    assert no_leftovers(tmp_path / "hf")


def test_not_a_checkpoint_is_refused(tmp_path, capsys, single_rank_parallel_state):
    (tmp_path / "empty").mkdir()
    assert "holds no complete checkpoint" in refused(
        capsys, "mcore-to-hf", "--load", tmp_path / "empty", "--save", tmp_path / "hf"
    )
    assert "is not a directory" in refused(
        capsys, "mcore-to-hf", "--load", tmp_path / "missing", "--save", tmp_path / "hf"
    )
    assert "has no config.json" in refused(
        capsys, "hf-to-mcore", "--load", tmp_path / "empty", "--save", tmp_path / "ckpt"
    )
    assert no_leftovers(tmp_path / "hf") and no_leftovers(tmp_path / "ckpt")


def test_hf_to_mcore_refuses_bad_folders(tmp_path_factory, tmp_path, capsys, single_rank_parallel_state):
    source, _ = imported(tmp_path_factory, "mha")

    def edited(name: str, **changes) -> Path:
        folder = tmp_path / name
        shutil.copytree(source, folder)
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    cases = [
        (edited("llama", model_type="llama"), "tensor(s) a Llama model does not have"),
        (edited("ffn", intermediate_size=512), "shape mismatch for 'model.layers.0.mlp.gate_proj.weight'"),
        (edited("eps", rms_norm_eps=1e-6), "head-norm epsilon"),
        (
            edited("rope", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "scaled RoPE",
        ),
    ]
    for folder, message in cases:
        assert message in refused(capsys, "hf-to-mcore", "--load", folder, "--save", tmp_path / "ckpt")
    clash = ["--", "--seq-length", "64", "--hidden-size", "128"]  # the model's shape comes from config.json
    assert "--hidden-size come(s) from config.json" in refused(
        capsys, "hf-to-mcore", "--load", source, "--save", tmp_path / "ckpt", *clash
    )
    assert no_leftovers(tmp_path / "ckpt")


def test_existing_output_needs_overwrite(tmp_path_factory, tmp_path, capsys, single_rank_parallel_state):
    ckpt = trained_tiny(tmp_path_factory, "tp1")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = convert("mcore-to-hf", "--load", ckpt, "--save", out)  # as users see it: one line, exit 2
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "already exists; pass --overwrite" in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"
    assert "overlaps --load" in refused(capsys, "mcore-to-hf", "--load", ckpt, "--save", ckpt / "inside")
    tool_main("convert_checkpoint")(["mcore-to-hf", "--load", str(ckpt), "--save", str(out), "--overwrite"])
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
