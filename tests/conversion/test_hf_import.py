"""The Transformer baseline <-> transformers' LlamaForCausalLM end to end, and Hugging Face folders loaded
in memory (`diffmeg.conversion.hf_import`): transformers' logits, bit-identical round trips both ways,
bad folders refused in one line before anything is written.

transformers runs in its own process (tests/conversion/hf_helper.py); our model runs here.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conversion.helpers import (
    GENERATE_TOKENS,
    LLAMA_GQA_HF,
    cached,
    convert_ok,
    exported_eval,
    hf_folder_variant,
    hf_outputs,
    max_relative_error,
    no_leftovers,
    our_logits,
    random_hf,
    read_safetensors_folder,
    refused,
    roundtrip_prompts,
    tiny_prompts,
)
from tests.data.helpers import find_bpe_file


@pytest.mark.hf_export
def test_baseline_export_loads_as_llama_with_our_logits(tmp_path_factory, single_rank_parallel_state):
    """Golden: transformers' LlamaForCausalLM on the export computes our baseline's fp32 logits and greedy
    continuations."""
    from diffmeg.generation import SamplingConfig, generate
    from tests.builders import load_model

    ckpt, exported = exported_eval(tmp_path_factory, "transformer")
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 8, 32)
    assert "lambda_std_dev" not in config and not (exported / "tokenizer.json").exists()  # vocab 512
    reference = cached(
        tmp_path_factory,
        "exported-eval-transformer-hf-outputs",
        lambda path: hf_outputs(path, exported, tiny_prompts(), GENERATE_TOKENS),
    )
    reference = torch.load(reference / "hf_out.pt")
    assert reference["class"] == "LlamaForCausalLM"
    model, _ = load_model(str(ckpt))
    for ids, theirs in zip(tiny_prompts(), reference["logits"], strict=True):
        ours = our_logits(model, ids)
        assert max_relative_error(ours, theirs) < 1e-5, ids.numel()  # measured: ~3e-7
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    # transformers' generate, with its KV cache as without it, continues every prompt as ours does
    version = reference["transformers"]
    assert reference["generated"] == reference["generated_nocache"], f"transformers {version}: KV cache"
    for ids, theirs in zip(tiny_prompts(), reference["generated"], strict=True):
        ours = generate(model, ids.tolist(), GENERATE_TOKENS, SamplingConfig(greedy=True))
        assert ours.output_ids == theirs[: len(ours.output_ids)], ids.numel()


def test_baseline_round_trip_is_bit_identical(tmp_path_factory, tmp_path, single_rank_parallel_state):
    """mcore -> Llama -> mcore gives the checkpoint's weights exactly (no head norm to fold), and the
    import exported again gives the same safetensors."""
    from diffmeg.checkpoints import load_model_weights

    ckpt, exported = exported_eval(tmp_path_factory, "transformer")
    convert_ok("hf-to-mcore", "--load", exported, "--save", tmp_path / "back", "--", "--seq-length", "64")
    original, _ = load_model_weights(str(ckpt))
    back, args = load_model_weights(str(tmp_path / "back"))
    assert args.diff_attention is False and args.seq_length == 64
    theirs = dict(back.named_parameters())
    for name, value in original.named_parameters():
        assert torch.equal(theirs[name], value), name
    convert_ok("mcore-to-hf", "--load", tmp_path / "back", "--save", tmp_path / "again")
    first, again = read_safetensors_folder(exported), read_safetensors_folder(tmp_path / "again")
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_random_llama_imports_exactly_and_loads_in_memory(tmp_path_factory, single_rank_parallel_state):
    """A random GQA Llama (cl100k vocabulary): hf-to-mcore -> mcore-to-hf is bit-identical (tokenizer
    included when the BPE file is here); the imported checkpoint and the folder mapped in memory
    (`load_hf_model`, no checkpoint written) give the same logits, transformers' to fp32 rounding."""
    from diffmeg.conversion.hf_import import analysis_args, load_hf_model, open_hf_folder
    from tests.builders import load_model

    source, reference = random_hf(tmp_path_factory, "random-llama-gqa", LLAMA_GQA_HF)
    assert reference["class"] == "LlamaForCausalLM"
    ckpt = tmp_path_factory.mktemp("llama-import") / "ckpt"
    convert_ok("hf-to-mcore", "--load", source, "--save", ckpt, "--tensor-model-parallel-size", "2")
    args = json.loads((ckpt / "iter_0000000" / "args.json").read_text())
    assert (args["num_attention_heads"], args["num_query_groups"], args["diff_attention"]) == (4, 2, False)
    assert args["norm_epsilon"] == 1e-6 and args["rotary_base"] == 50000.0
    out = ckpt.parent / "hf"
    tokenizer_file = find_bpe_file()
    convert_ok(
        "mcore-to-hf",
        "--load",
        ckpt,
        "--save",
        out,
        *(["--tokenizer-file", tokenizer_file] if tokenizer_file else ["--no-tokenizer"]),
    )
    original, back = read_safetensors_folder(source), read_safetensors_folder(out)
    assert back.keys() == original.keys()
    for key in original:
        assert back[key].dtype == original[key].dtype and torch.equal(back[key], original[key]), key
    if tokenizer_file:
        assert (out / "tokenizer.json").exists()
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 100257

    imported_model, _ = load_model(str(ckpt))
    folder = open_hf_folder(str(source))
    in_memory = load_hf_model(folder, analysis_args(folder))
    for ids, theirs in zip(roundtrip_prompts(LLAMA_GQA_HF["vocab_size"]), reference["logits"], strict=True):
        ours = our_logits(in_memory, ids)
        assert torch.equal(ours, our_logits(imported_model, ids))
        assert max_relative_error(ours, theirs) < 1e-5, ids.numel()


def test_tied_llama_stays_tied_both_ways(tmp_path_factory, tmp_path, single_rank_parallel_state):
    """A tied Llama folder (tie_word_embeddings, no lm_head) imports as a tied model (no output-layer
    tensor in the checkpoint, --tie-embeddings-and-output-weights recorded) and exports back bit for bit,
    still tied; transformers' LlamaForCausalLM loads the export with lm_head tied to the embedding and
    computes our logits."""
    from diffmeg.conversion.checkpoint_io import McoreCheckpointReader
    from tests.builders import load_model
    from tests.conversion.upcycle_helpers import llama_folder

    source = llama_folder(tmp_path_factory, "llama-gqa-tied", tied=True)
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    convert_ok("hf-to-mcore", "--load", source, "--save", ckpt)
    reader = McoreCheckpointReader(str(ckpt))
    assert reader.args.tie_embeddings_and_output_weights
    assert reader.stored_shape("output_layer.weight") is None
    convert_ok("mcore-to-hf", "--load", ckpt, "--save", out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    original, back = read_safetensors_folder(source), read_safetensors_folder(out)
    assert back.keys() == original.keys() and "lm_head.weight" not in back
    for key in original:
        assert back[key].dtype == original[key].dtype and torch.equal(back[key], original[key]), key

    prompts = roundtrip_prompts(300)
    reference = hf_outputs(tmp_path / "hf-out", out, prompts)
    assert reference["class"] == "LlamaForCausalLM" and reference["tied"]
    model, _ = load_model(str(ckpt))
    assert model.output_layer.weight is None
    for ids, theirs in zip(prompts, reference["logits"], strict=True):
        assert max_relative_error(our_logits(model, ids), theirs) < 1e-5, ids.numel()


def test_diffllama_folder_loads_in_memory_like_its_import(tmp_path_factory, single_rank_parallel_state):
    """The DIFF path of `load_hf_model` equals hf-to-mcore's checkpoint (both map the same way)."""
    from diffmeg.conversion.hf_import import analysis_args, load_hf_model, open_hf_folder
    from tests.builders import load_model
    from tests.conversion.helpers import imported

    source, ckpt = imported(tmp_path_factory, "mha")
    folder = open_hf_folder(str(source))
    args = analysis_args(folder)
    assert args.diff_attention is True and args.tokenizer_type == "null"  # vocab 512: no cl100k ids
    in_memory = load_hf_model(folder, args)
    imported_model, _ = load_model(str(ckpt))
    ids = roundtrip_prompts(512)[2]
    assert torch.equal(our_logits(in_memory, ids), our_logits(imported_model, ids))


# ---------------------------------------------------------------------------------- bad input


def test_bad_llama_folders_are_refused(tmp_path_factory, tmp_path, capsys, single_rank_parallel_state):
    _, llama = exported_eval(tmp_path_factory, "transformer")
    _, diffllama = exported_eval(tmp_path_factory, "diff")
    cases = [
        (hf_folder_variant(llama, tmp_path / "mistral", model_type="mistral"), "model_type 'mistral'"),
        (  # a DiffLlama relabelled llama: its lambda vectors have no place in a Llama
            hf_folder_variant(diffllama, tmp_path / "relabelled", model_type="llama"),
            "has model_type 'llama' but the weights hold 16 tensor(s) a Llama model does not have",
        ),
        (hf_folder_variant(llama, tmp_path / "mlp-bias", mlp_bias=True), "biases are not supported"),
        (hf_folder_variant(llama, tmp_path / "kv", num_key_value_heads=4), "shape mismatch for"),
    ]
    bin_only = hf_folder_variant(
        llama, tmp_path / "bin", drop=("model.safetensors.index.json", "model-00001-of-00001.safetensors")
    )
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    cases.append((bin_only, "holds PyTorch .bin weights"))
    for folder, message in cases:
        err = refused(
            capsys, "convert_checkpoint", "hf-to-mcore", "--load", folder, "--save", tmp_path / "ckpt"
        )
        assert message in err, err
    assert no_leftovers(tmp_path / "ckpt")


def test_baseline_args_on_diff_weights_are_refused(
    tmp_path_factory, tmp_path, capsys, single_rank_parallel_state
):
    """args.json saying --no-diff-attention over a DIFF checkpoint's tensors: refused, not made a Llama."""
    import shutil

    ckpt, _ = exported_eval(tmp_path_factory, "diff")
    edited = tmp_path / "ckpt"
    shutil.copytree(ckpt, edited)
    args_file = next(edited.glob("iter_*")) / "args.json"
    args_file.write_text(json.dumps({**json.loads(args_file.read_text()), "diff_attention": False}))
    err = refused(capsys, "convert_checkpoint", "mcore-to-hf", "--load", edited, "--save", tmp_path / "hf")
    assert "describes the Transformer baseline" in err
    assert no_leftovers(tmp_path / "hf")


@pytest.mark.parametrize("field, value", [("num_attention_heads", 4), ("rms_norm_eps", 1e-6)])
def test_layout_mismatch_with_weights_is_refused_by_open_hf_folder(tmp_path_factory, tmp_path, field, value):
    from diffmeg.conversion.hf_import import open_hf_folder
    from diffmeg.errors import DiffmegError

    _, diffllama = exported_eval(tmp_path_factory, "diff")
    folder = hf_folder_variant(diffllama, tmp_path / "bad", **{field: value})
    with pytest.raises(DiffmegError) as info:
        open_hf_folder(str(folder))
    assert "\n" not in str(info.value)
