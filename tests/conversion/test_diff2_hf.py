"""DIFF V2 <-> Hugging Face: a LLaMA-layout folder with diffmeg's modeling file (auto_map), loaded by
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`; transformers' logits and cached
generation equal ours, and hf-to-mcore gives the checkpoint's weights back bit for bit. Grouped
differential attention (GDA, `--num-noise-heads`) exports the same way, with `num_noise_heads` in
config.json and h + n query heads in q_proj; the 1:1 export has no such field.

transformers runs in its own process (tests/conversion/hf_helper.py); our model runs here.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from diffmeg.conversion.layout import Diff2Layout
from diffmeg.errors import DiffmegError
from tests.conversion import layouts
from tests.conversion.helpers import (
    cached,
    convert_ok,
    hf_folder_variant,
    hf_helper,
    hf_outputs,
    max_relative_error,
    our_logits,
    read_safetensors_folder,
    tiny_prompts,
)
from tests.data.helpers import find_bpe_file

V2_GQA = ["--model", "diff2-tiny", "--num-query-groups", "2", "--train-iters", "2"]  # 8 heads over 2 KV heads
GDA = ["--model", "gda-tiny", "--train-iters", "2"]  # 8 signal heads, 2 noise heads (4:1), 2 KV heads
NEW_TOKENS = 8


def _trained_v2(factory, name: str, extra: list[str], nproc: int = 1, model: list[str] = V2_GQA):
    from tests.distributed.runner import run_training

    def build(path):
        run_training(path.parent, path.name, [*model, *extra, "--save", str(path)], nproc=nproc)

    return cached(factory, name, build)


def _exported(factory, ckpt, name: str):
    return cached(factory, name, lambda path: convert_ok("mcore-to-hf", "--load", ckpt, "--save", path))


@pytest.mark.hf_export
def test_v2_export_loads_with_remote_code_and_computes_our_logits(
    tmp_path_factory, single_rank_parallel_state
):
    from diffmeg.generation import SamplingConfig, generate
    from tests.builders import load_model

    ckpt = _trained_v2(tmp_path_factory, "v2-tp1", [])
    folder = _exported(tmp_path_factory, ckpt, "v2-tp1-hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Diff2ForCausalLM"] and config["model_type"] == "llama"
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling_diff2.Diff2ForCausalLM"}
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 2, 32)
    assert "num_noise_heads" not in config  # the 1:1 model's config.json is what it was before GDA
    assert (folder / "modeling_diff2.py").is_file()
    tensors = read_safetensors_folder(folder)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (16 * 32, 256)  # 2h query heads
    assert tensors["model.layers.0.self_attn.lambda_proj.weight"].shape == (8, 256)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (256, 8 * 32)

    prompts = tiny_prompts()
    reference = hf_outputs(tmp_path_factory.mktemp("v2hf"), folder, prompts, NEW_TOKENS)
    assert reference["class"] == "Diff2ForCausalLM"
    model, _ = load_model(str(ckpt))
    for ids, theirs in zip(prompts, reference["logits"], strict=True):
        assert max_relative_error(our_logits(model, ids), theirs) < 1e-5, ids.numel()
    # transformers' generate continues every prompt as ours does, with its KV cache as without it
    version = reference["transformers"]
    assert reference["generated"] == reference["generated_nocache"], f"transformers {version}: KV cache"
    for ids, theirs in zip(prompts, reference["generated"], strict=True):
        ours = generate(model, ids.tolist(), NEW_TOKENS, SamplingConfig(greedy=True))
        assert ours.output_ids == theirs[: len(ours.output_ids)], ids.numel()


@pytest.mark.hf_export
def test_v2_config_and_tokenizer_load_without_remote_code_and_without_a_word(tmp_path_factory, tmp_path):
    """A user's `AutoTokenizer.from_pretrained(folder)` (transformers 5 reads the model's config first)
    neither asks `[y/N]` for remote code nor warns that a `diffmeg_diff2` config builds a `''` one; nor
    does the model's load with its remote code."""
    from diffmeg.conversion.checkpoint_io import save_hf_tokenizer
    from diffmeg.conversion.tokenizer_export import build_fast_tokenizer
    from diffmeg.data.tiktoken_cl100k import load_tokenizer

    bpe = find_bpe_file()
    if bpe is None:
        pytest.skip("cl100k_base BPE file not found; set DIFFMEG_TOKENIZER_FILE")
    ckpt = _trained_v2(tmp_path_factory, "v2-tp1", [])
    # The export's config.json, with the tokenizer an export of a cl100k_base model writes beside it (the
    # trained test model has a mock vocabulary, exported without one).
    folder = hf_folder_variant(_exported(tmp_path_factory, ckpt, "v2-tp1-hf"), tmp_path / "hf")
    save_hf_tokenizer(build_fast_tokenizer(load_tokenizer(bpe).encoding, 256), str(folder))
    out = tmp_path / "load.json"
    proc = hf_helper("load", "--model", folder, "--text", "hello world", "--out", out, verbosity="warning")
    said = proc.stdout + proc.stderr
    for noise in ("custom code", "[y/N]", "trust_remote_code", "to instantiate a model of type"):
        assert noise not in said, said[-3000:]
    assert json.loads(out.read_text()) == {
        "config": "LlamaConfig",
        "ids": [15339, 1917],
        "class": "Diff2ForCausalLM",
    }


def test_v2_configs_are_told_apart_from_llama_by_their_architecture():
    from diffmeg.conversion.hf_config import check_model_type
    from diffmeg.conversion.layout import Diff2Layout, LlamaLayout

    assert check_model_type({"model_type": "llama", "architectures": ["Diff2ForCausalLM"]}) is Diff2Layout
    assert check_model_type({"model_type": "diffmeg_diff2"}) is Diff2Layout  # exports up to 2026-11-27
    assert check_model_type({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}) is LlamaLayout
    assert check_model_type({"model_type": "llama"}) is LlamaLayout


def test_v2_round_trip_is_bit_identical_from_any_layout(
    tmp_path_factory, tmp_path, single_rank_parallel_state
):
    """mcore -> HF -> mcore gives the weights back exactly, without a word from transformers on the way;
    a TP=2 source exports the TP=1 tensors."""
    from diffmeg.checkpoints import load_model_weights

    ckpt = _trained_v2(tmp_path_factory, "v2-tp1", [])
    folder = _exported(tmp_path_factory, ckpt, "v2-tp1-hf")
    back = ["--save", tmp_path / "back", "--", "--seq-length", "64"]
    proc = convert_ok("hf-to-mcore", "--load", folder, *back)
    for noise in ("to instantiate a model of type", "Failed to load", "register_constant"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    original, _ = load_model_weights(str(ckpt))
    back, args = load_model_weights(str(tmp_path / "back"))
    assert args.diff_attention is True and args.diff_version == 2 and args.num_query_groups == 2
    theirs = dict(back.named_parameters())
    for name, value in original.named_parameters():
        assert torch.equal(theirs[name], value), name

    tp2 = _trained_v2(tmp_path_factory, "v2-tp2", ["--tensor-model-parallel-size", "2"], nproc=2)
    from_tp2 = read_safetensors_folder(_exported(tmp_path_factory, tp2, "v2-tp2-hf"))
    from_tp1 = read_safetensors_folder(folder)
    assert from_tp2.keys() == from_tp1.keys()
    for key, value in from_tp1.items():  # same run at another layout: Adam-rounding differences only
        torch.testing.assert_close(from_tp2[key], value, rtol=1e-4, atol=5e-5, msg=key)


def test_v2_attention_takes_the_cache_under_any_name_it_is_passed():
    """The remote code's attention hands a KV cache on under the name the installed transformers' LLaMA
    attention takes, whichever name the caller used; two different caches are refused."""
    import pytest
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicCache

    from diffmeg.conversion.modeling_diff2 import Diff2ForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Diff2ForCausalLM(config).eval()
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 3, 32)
    rope = model.model.rotary_emb(x, torch.arange(3).unsqueeze(0))
    for name in ("cache", "past_key_values", "past_key_value"):
        cache = DynamicCache()
        with torch.no_grad():
            out, _ = attention(x, position_embeddings=rope, attention_mask=None, **{name: cache})
        assert cache.get_seq_length(0) == 3, name  # the cache was updated, not ignored
        assert out.shape == (1, 3, 32) and attention.o_proj.lam is None
    with pytest.raises(TypeError, match="several KV caches"):
        attention(x, position_embeddings=rope, cache=DynamicCache(), past_key_values=DynamicCache())


GDA_LAYOUTS = {  # (h signal heads, g KV heads, n noise heads): Motif-3's n = g, n a multiple of g, the pairs
    "gda-n-equals-g": (4, 2, 2),
    "gda-mqa": (6, 1, 2),
    "gda-one-noise-head": (4, 1, 1),
    "pairs": (4, 2, 4),
}


def _gda_layout(name: str) -> Diff2Layout:
    h, g, n = GDA_LAYOUTS[name]
    return layouts.tiny_layout(
        Diff2Layout, h, g, hidden_size=24, ffn_hidden_size=40, head_dim=6, norm_eps=1e-5, num_noise_heads=n
    )


@pytest.mark.parametrize("name", list(GDA_LAYOUTS))
def test_gda_q_proj_holds_the_groups_and_both_directions_are_exact(name):
    """q_proj is the h + n query heads group by group `[signal x r, noise]`, each group inside the KV head
    transformers' repeat_kv gives it; config.json and the pretrain_diff.py flags carry n (the 1:1 model:
    neither does); mcore -> HF -> mcore is exact."""
    from diffmeg.conversion.hf_config import hf_config_dict, layout_from_args, layout_from_hf_config
    from diffmeg.conversion.mapping import hf_to_mcore, mcore_to_hf
    from tests.reference_model import fused_qkv_blocks, signal_and_noise

    h, g, n = GDA_LAYOUTS[name]
    layout, d, r = _gda_layout(name), 6, h // n
    sd = layouts.random_mcore(layout)
    hf = layouts.flatten(mcore_to_hf(sd, layout))
    q = hf["model.layers.0.self_attn.q_proj.weight"].view(h + n, d, -1)
    k = hf["model.layers.0.self_attn.k_proj.weight"].view(g, d, -1)
    wq, wk, _ = fused_qkv_blocks(sd["decoder.layers.0.self_attention.linear_qkv.weight"], h + n, g, d)
    signal, noise = signal_and_noise(wq, n)
    for j in range(h):  # signal head j of group m = j // r: its noise head and KV head with it
        m = j // r
        assert torch.equal(q[m * (r + 1) + j % r], signal[j]) and torch.equal(q[m * (r + 1) + r], noise[m])
        assert torch.equal(k[(m * (r + 1)) // ((h + n) // g)], wk[m // (n // g)])  # repeat_kv: one KV head
    back = layouts.flatten(hf_to_mcore(hf, layout))
    assert back.keys() == sd.keys() and all(torch.equal(back[key], sd[key]) for key in sd)

    config = hf_config_dict(layout, dtype="float32", bos_token_id=None, eos_token_id=None)
    assert ("num_noise_heads" in config) == (n < h)
    assert config.get("num_noise_heads") == (n if n < h else None)
    assert layout_from_hf_config(layouts.hf_config(layout)) == layout
    assert layout_from_args(layouts.pretrain_args(layout)) == layout
    assert layouts.pretrain_args(layout).num_noise_heads == n


@pytest.mark.parametrize("name", list(GDA_LAYOUTS))
def test_gda_remote_code_computes_the_float64_definition(name):
    """transformers' Diff2ForCausalLM (the exported modeling file) in float64 on the mapped weights computes
    the logits of the equations on megatron-core's layout (tests/reference_model.py), grouped or 1:1."""
    from transformers import LlamaConfig

    from diffmeg.conversion.hf_config import hf_config_dict
    from diffmeg.conversion.mapping import mcore_to_hf
    from diffmeg.conversion.modeling_diff2 import Diff2ForCausalLM
    from tests.reference_model import reference_logits_v2, semantic_weights_v2_from_mcore

    h, g, n = GDA_LAYOUTS[name]
    layout = _gda_layout(name)
    sd = layouts.random_mcore(layout, seed=1)
    config = LlamaConfig(**hf_config_dict(layout, dtype="float64", bos_token_id=None, eos_token_id=None))
    model = Diff2ForCausalLM(config).double().eval()
    model.load_state_dict(layouts.flatten(mcore_to_hf(sd, layout)), strict=True)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == ((h + n) * 6, 24)
    assert attention.num_key_value_groups == (h + n) // g
    tokens = torch.randint(0, layout.vocab_size, (11,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = model(tokens[None]).logits[0]
    cfg = {"heads": h, "kv_heads": g, "noise_heads": n, "head_dim": 6, "layers": layout.num_layers}
    ours = reference_logits_v2(tokens, semantic_weights_v2_from_mcore(sd, cfg), {"rotary_base": 500.0, **cfg})
    err = max_relative_error(theirs, ours)
    assert err < 2e-6, err  # transformers' RoPE tables are float32 (measured: 3.2e-7 to 4.5e-7)


def test_gda_layouts_that_cannot_be_are_refused():
    """A grouping our model cannot build (from a config.json, say) is one line; n = h is the 1:1 layout."""
    pairs = _gda_layout("pairs")  # 4 heads over 2 KV heads
    assert pairs.num_noise_heads is None and dataclasses.replace(pairs, num_noise_heads=None) == pairs
    with pytest.raises(DiffmegError, match="num_noise_heads 3 must divide the 4 DIFF V2 heads"):
        dataclasses.replace(pairs, num_noise_heads=3)
    with pytest.raises(DiffmegError, match="num_noise_heads 1 must .* be a multiple of the 2 KV heads"):
        dataclasses.replace(pairs, num_noise_heads=1)


@pytest.mark.hf_export
def test_gda_export_generates_our_tokens_and_imports_back_bit_exact(
    tmp_path_factory, tmp_path, single_rank_parallel_state
):
    """gda-tiny (8 signal heads sharing 2 noise heads over 2 KV heads), trained at TP=2: the export carries
    num_noise_heads and h + n query heads; transformers (remote code) computes our logits and its generate,
    with its KV cache as without it, continues every prompt as ours does (tools/generate.py's function);
    hf-to-mcore gives the checkpoint's weights back tensor for tensor."""
    from diffmeg.checkpoints import load_model_weights
    from diffmeg.generation import SamplingConfig, generate
    from tests.builders import load_model

    ckpt = _trained_v2(tmp_path_factory, "gda-tp2", ["--tensor-model-parallel-size", "2"], nproc=2, model=GDA)
    folder = _exported(tmp_path_factory, ckpt, "gda-tp2-hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Diff2ForCausalLM"] and config["num_noise_heads"] == 2
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    tensors = read_safetensors_folder(folder)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (10 * 32, 256)  # h + n query heads
    assert tensors["model.layers.0.self_attn.lambda_proj.weight"].shape == (8, 256)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (256, 8 * 32)

    prompts = tiny_prompts()
    reference = hf_outputs(tmp_path / "hf", folder, prompts, NEW_TOKENS)
    assert reference["class"] == "Diff2ForCausalLM"
    model, _ = load_model(str(ckpt))
    for ids, theirs in zip(prompts, reference["logits"], strict=True):
        assert max_relative_error(our_logits(model, ids), theirs) < 1e-5, ids.numel()
    version = reference["transformers"]
    assert reference["generated"] == reference["generated_nocache"], f"transformers {version}: KV cache"
    for ids, theirs in zip(prompts, reference["generated"], strict=True):
        ours = generate(model, ids.tolist(), NEW_TOKENS, SamplingConfig(greedy=True))
        assert ours.output_ids == theirs[: len(ours.output_ids)], ids.numel()

    convert_ok("hf-to-mcore", "--load", folder, "--save", tmp_path / "back", "--", "--seq-length", "64")
    original, _ = load_model_weights(str(ckpt))
    back, args = load_model_weights(str(tmp_path / "back"))
    assert (args.diff_version, args.num_noise_heads, args.num_query_groups) == (2, 2, 2)
    theirs = dict(back.named_parameters())
    assert theirs.keys() == dict(original.named_parameters()).keys()
    for name, value in original.named_parameters():
        assert torch.equal(theirs[name], value), name
