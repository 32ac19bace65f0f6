"""Upcycling a Transformer into DIFF V2 (diffmeg.conversion.upcycle, upcycle_io; `convert_checkpoint.py
upcycle`): the function is preserved exactly.

- float64: the upcycled model's logits equal its source's through the same megatron-core path, for a
  diffmeg Transformer's tensors and for Llama folders (GQA tied and untied, MHA), and transformers'
  float64 `LlamaForCausalLM` agrees within its float32 RoPE; a tied source gives a tied model;
- the Hugging Face round trip of an upcycled model is bit-exact, keeps the source's tokenizer files, and
  transformers' DIFF V2 (remote code) computes the source Llama's logits;
- what cannot upcycle exactly is refused in one line.

transformers' models run in their own process (tests/conversion/hf_helper.py); ours run here.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json

import pytest
import torch

from diffmeg.conversion.layout import LlamaLayout
from diffmeg.conversion.upcycle import diff2_layout, upcycle_blocks, upcycle_qkv
from tests.conversion import layouts
from tests.conversion.helpers import (
    convert_ok,
    hf_outputs,
    max_relative_error,
    read_safetensors_folder,
    refused,
)
from tests.conversion.upcycle_helpers import llama_folder, tiny_llama_layout, upcycled, write_llama_folder
from tests.tools.helpers import run_tool

LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1), "gqa-r3": (6, 2)}  # (n heads, g KV heads)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_query_head_becomes_a_pair_in_its_kv_group(name):
    """V2 query heads 2i and 2i+1 are the Transformer's head i, in the KV group of head i; keys and values
    are the source's."""
    n, g = LAYOUTS[name]
    source = layouts.tiny_layout(
        LlamaLayout, n, g, hidden_size=32, ffn_hidden_size=48, head_dim=8, norm_eps=1e-5
    )
    target = diff2_layout(source)
    qkv = layouts.random_mcore(source)["decoder.layers.0.self_attention.linear_qkv.weight"]
    out = upcycle_qkv(qkv, source)
    assert out.shape == (target.qkv_rows, 32) and target.num_heads == n and target.num_kv_heads == g
    d, r = 8, n // g
    src = qkv.view(g, r + 2, d, -1)  # per group: [r queries, key, value]
    dst = out.view(g, 2 * r + 2, d, -1)  # per group: [2r queries, key, value]
    for i in range(n):
        for j in (2 * i, 2 * i + 1):  # V2 query head j uses KV head j // (2n / g) = i // r
            assert j // (2 * n // g) == i // r
            assert torch.equal(dst[j // (2 * r), j % (2 * r)], src[i // r, i % r])
    assert torch.equal(dst[:, 2 * r :], src[:, r:])


def _logits(args, blocks, tokens: torch.Tensor) -> torch.Tensor:
    """float64 logits [s, V] of the single-rank model of `args` filled with `blocks` (float64 tensors)."""
    from diffmeg.checkpoints import build_single_rank_model
    from diffmeg.conversion.checkpoint_io import fill_model

    model = build_single_rank_model(args).double()
    tied = bool(args.tie_embeddings_and_output_weights)
    assert model.share_embeddings_and_output_weights == tied and (model.output_layer.weight is None) == tied
    fill_model(model, blocks)
    model.eval()
    with torch.no_grad():
        out = model(
            input_ids=tokens[None], position_ids=torch.arange(tokens.numel())[None], attention_mask=None
        )
    assert out.dtype == torch.float64
    return out[0]


SOURCES = {  # name: Llama folder (name, tied, heads, KV heads), or a diffmeg Transformer's tensors (tied)
    "transformer-gqa": False,
    "transformer-gqa-tied": True,
    "llama-gqa-untied": ("llama-gqa", False, 4, 2),
    "llama-gqa-tied": ("llama-gqa-tied", True, 4, 2),
    "llama-mha": ("llama-mha", False, 4, 4),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_upcycled_logits_equal_the_source_in_float64(name, tmp_path_factory, single_rank_parallel_state):
    """Golden: through one float64 megatron-core path, DIFF V2 upcycled from a Transformer gives the
    Transformer's logits (lambda = sigmoid(0) = 1/2 and the doubled output projection are exact); a Llama
    folder read through that path also gives transformers' float64 LlamaForCausalLM logits, up to the
    float32 RoPE tables both sides compute."""
    from diffmeg.conversion.hf_import import resolved_pretrain_args
    from diffmeg.conversion.upcycle_io import open_upcycle_source, upcycled_args

    tokens = torch.randint(0, 300, (48,), generator=torch.Generator().manual_seed(5))
    hf = isinstance(SOURCES[name], tuple)
    if not hf:
        layout = dataclasses.replace(tiny_llama_layout(4, 2), tied=SOURCES[name])
        state = layouts.random_mcore(layout, seed=11)  # float64, norms off one
        args = resolved_pretrain_args(layout, {}, ["--mock-data"])

        def blocks():
            yield dict(state)

        source_blocks = blocks
    else:
        folder_name, tied, heads, kv_heads = SOURCES[name]
        folder = llama_folder(tmp_path_factory, folder_name, tied=tied, heads=heads, kv_heads=kv_heads)
        source = open_upcycle_source(str(folder))
        layout = source.layout
        assert layout.tied == tied and ("output layer tied to the embedding" in source.description) == tied
        args = resolved_pretrain_args(layout, {}, source.tokenizer.flags())

        def source_blocks():
            return source.blocks(torch.float64)

    theirs = _logits(args, source_blocks(), tokens)
    target_args = (
        upcycled_args(source)[1]
        if hf
        else resolved_pretrain_args(diff2_layout(layout), {}, ["--mock-data"])
    )
    assert target_args.diff_attention and target_args.diff_version == 2
    # A tied source gives a tied model (one matrix: no output layer of its own), an untied one an untied.
    assert target_args.tie_embeddings_and_output_weights == layout.tied
    ours = _logits(target_args, upcycle_blocks(source_blocks(), layout), tokens)
    err = max_relative_error(ours, theirs)
    assert err < 1e-12, err  # measured: 8e-16 to 1.2e-15
    if hf:
        reference = hf_outputs(tmp_path_factory.mktemp(f"{name}-hf"), folder, [tokens], dtype="float64")
        assert reference["class"] == "LlamaForCausalLM"
        hf_err = max_relative_error(ours, reference["logits"][0])
        assert hf_err < 2e-6, hf_err  # float32 RoPE tables on both sides (measured 1.4e-7-1.7e-7)


@pytest.mark.hf_export
def test_hf_round_trip_of_an_upcycled_llama_is_bit_exact(
    tmp_path_factory, tmp_path, single_rank_parallel_state
):
    """upcycle -> mcore-to-hf -> hf-to-mcore gives the upcycled weights bit for bit; the export carries the
    source's tokenizer files unchanged (not cl100k_base) and its ids; the evaluation tools read the source
    folder, the checkpoint and the export with that tokenizer and measure one function; transformers' DIFF
    V2 (remote code) computes the source Llama's float64 logits."""
    from diffmeg.checkpoints import load_model_weights, read_checkpoint_args

    source = llama_folder(tmp_path_factory, "llama-gqa-tied", tied=True)
    ckpt = upcycled(tmp_path_factory, source, "upcycled-llama-gqa-tied")
    args, _ = read_checkpoint_args(str(ckpt))
    assert (args.tokenizer_type, args.tokenizer_model) == ("HuggingFaceTokenizer", str(ckpt / "tokenizer"))
    assert args.diff_version == 2 and args.rotary_base == 5000.0 and args.norm_epsilon == 1e-6
    assert (args.num_attention_heads, args.num_query_groups, args.vocab_size) == (4, 2, 320)
    exported = tmp_path / "hf"
    convert_ok("mcore-to-hf", "--load", ckpt, "--save", exported)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(source / name, exported / name, shallow=False), name
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Diff2ForCausalLM"] and (
        config["bos_token_id"],
        config["eos_token_id"],
    ) == (1, 2)
    assert config["tie_word_embeddings"] is True and args.tie_embeddings_and_output_weights  # the source's
    tensors = read_safetensors_folder(exported)
    assert not tensors["model.layers.0.self_attn.lambda_proj.weight"].any()
    assert "lm_head.weight" not in tensors  # tied: the embedding is the output layer

    convert_ok("hf-to-mcore", "--load", exported, "--save", tmp_path / "back")
    original, _ = load_model_weights(str(ckpt))
    back, back_args = load_model_weights(str(tmp_path / "back"))
    assert back_args.tokenizer_type == "HuggingFaceTokenizer" and back_args.diff_version == 2
    assert back_args.tie_embeddings_and_output_weights and back.output_layer.weight is None  # still tied
    theirs = dict(back.named_parameters())
    for name, value in original.named_parameters():
        assert torch.equal(theirs[name], value), name

    # The evaluation tools read all three with the source's tokenizer and find one function.
    for k in range(3):
        (tmp_path / f"doc{k}.txt").write_text(" ".join(f"the quick brown fox {k} {i}" for i in range(40)))
    proc = run_tool(
        "eval_long_context", "--load", source, ckpt, exported, "--text-files", tmp_path / "doc*.txt",
        "--max-length", "48", "--output-dir", tmp_path / "nll", "--no-plot",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "nll" / "summary.json").read_text())
    nll = [entry["final_cumulative_nll"] for entry in summary["checkpoints"]]
    assert summary["documents"] and all(
        e["args"]["tokenizer_type"] == "HuggingFaceTokenizer" for e in summary["checkpoints"]
    )
    assert nll[1] == pytest.approx(nll[0], rel=1e-6) and nll[2] == pytest.approx(nll[0], rel=1e-6)

    tokens = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (1, 33)]
    llama = hf_outputs(tmp_path / "llama", source, tokens, generate=6, dtype="float64")
    diff2 = hf_outputs(tmp_path / "diff2", exported, tokens, generate=6, dtype="float64")
    assert diff2["class"] == "Diff2ForCausalLM" and diff2["tied"] and llama["tied"]
    for ours, theirs in zip(diff2["logits"], llama["logits"], strict=True):
        assert max_relative_error(ours, theirs) < 1e-12  # one RoPE table, exact head pairs
    # and so does transformers' generate, with its KV cache as without it
    version = diff2["transformers"]
    assert diff2["generated"] == diff2["generated_nocache"] == llama["generated"], f"transformers {version}"


def test_training_refuses_cl100k_for_an_upcycled_llama(tmp_path_factory, tmp_path):
    """pretrain_diff.py from the upcycled checkpoint with cl100k_base (a flag beside
    --use-checkpoint-args wins) stops before building anything, naming the tokenizer to use."""
    from tests.distributed.runner import run_pretrain

    ckpt = upcycled(
        tmp_path_factory,
        llama_folder(tmp_path_factory, "llama-gqa-tied", tied=True),
        "upcycled-llama-gqa-tied",
    )
    argv = ["--use-checkpoint-args", "--pretrained-checkpoint", str(ckpt), "--tokenizer-type", "cl100k_base"]
    proc = run_pretrain([*argv, "--lr", "1e-4", "--train-iters", "1", "--seq-length", "32"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {ckpt}/iter_0000000 holds a model of the ids of the Hugging Face tokenizer "
        f"{ckpt}/tokenizer (vocabulary {_fingerprint(ckpt)[:12]}), but this run uses cl100k_base; "
        f"continue it with --tokenizer-type HuggingFaceTokenizer --tokenizer-model {ckpt}/tokenizer "
        "(and data tokenized with it)"
    )


def _fingerprint(ckpt) -> str:
    return json.loads((ckpt / "iter_0000000" / "args.json").read_text())["tokenizer_fingerprint"]


@pytest.mark.parametrize(
    "model_type, changes, message",
    [
        ("qwen2", {}, "Qwen2 model: its q_proj, k_proj and v_proj have biases"),
        ("mistral", {"sliding_window": 16}, "sliding_window 16 < max_position_embeddings 64"),
        ("llama", {"model_type": "diffllama"}, "already a DIFF model"),
        ("llama", {"architectures": ["Diff2ForCausalLM"]}, "already a DIFF model (DIFF V2)"),
        ("llama", {"model_type": "diffmeg_diff2"}, "already a DIFF model (DIFF V2)"),
        ("llama", {"model_type": "gemma"}, "model_type 'gemma'; upcycling takes a Llama-family model"),
        ("llama", {"attention_bias": True}, "biases are not supported"),
    ],
)
def test_what_cannot_upcycle_exactly_is_refused_in_one_line(tmp_path, capsys, model_type, changes, message):
    folder = tmp_path / "src"
    write_llama_folder(folder, tiny_llama_layout(), model_type=model_type)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    err = refused(capsys, "convert_checkpoint", "upcycle", "--load", folder, "--save", tmp_path / "out")
    assert message in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [["--num-noise-heads", "2"], ["--num-noise-heads=1"]])
def test_upcycling_into_grouped_differential_attention_is_refused_in_one_line(tmp_path, capsys, flags):
    """Only one noise head per head is function-preserving (DESIGN.md "Grouped differential attention"): a
    grouped target is refused before anything is written, saying why and what is exact; n = h by name is
    today's exact upcycle."""
    from diffmeg.conversion.upcycle_io import open_upcycle_source, upcycled_args

    folder = tmp_path / "src"
    write_llama_folder(folder, tiny_llama_layout(4, 2))
    argv = ["upcycle", "--load", folder, "--save", tmp_path / "out", "--", *flags]
    err = refused(capsys, "convert_checkpoint", *argv)
    n = flags[-1].rpartition("=")[2]
    assert err == (
        f"error: upcycling into grouped differential attention (--num-noise-heads {n} for 4 heads) is not "
        "exact: with several signal heads per noise head no bias-free sigmoid lambda removes the shared "
        "noise map and the signal heads cannot all equal it, so it would be a warm start, not the source's "
        "function; only one noise head per head (--num-noise-heads 4, the default, over any KV grouping) "
        "upcycles exactly: leave --num-noise-heads out"
    )
    assert not (tmp_path / "out").exists()
    target, args = upcycled_args(open_upcycle_source(str(folder)), ["--num-noise-heads", "4"])
    assert target.num_noise_heads is None and (args.num_noise_heads, args.num_query_groups) == (4, 2)


def test_mistral_without_a_window_reads_as_llama_and_other_inputs_are_refused(tmp_path, capsys):
    from diffmeg.conversion.upcycle_io import open_upcycle_source

    layout = tiny_llama_layout()
    write_llama_folder(tmp_path / "mistral", layout, model_type="mistral", sliding_window=None)
    source = open_upcycle_source(str(tmp_path / "mistral"))
    assert source.layout == layout and source.description.startswith("Hugging Face MistralForCausalLM")
    (tmp_path / "empty").mkdir()
    err = refused(
        capsys, "convert_checkpoint", "upcycle", "--load", tmp_path / "empty", "--save", tmp_path / "o"
    )
    assert "neither a pretrain_diff.py checkpoint" in err
    argv = ["upcycle", "--load", tmp_path / "mistral", "--save", tmp_path / "o", "--", "--num-layers", "3"]
    err = refused(capsys, "convert_checkpoint", *argv)
    assert "--num-layers come(s) from config.json" in err
