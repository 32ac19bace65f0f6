"""Motif Technologies' Hugging Face checkpoints (`model_type: motif`) imported with `hf-to-mcore`: tiny
folders of both layouts (Motif-2.6B's paired sub-heads, Motif-2-12.7B's grouped differential attention with
`num_noise_heads`) made here with random weights, their import's logits against a float64 forward written
below from Motif's format (not from diffmeg's code), and one refusal per config key we cannot represent.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import pytest
import torch

from tests.conversion.helpers import (
    cached,
    convert_ok,
    hf_folder_variant,
    max_relative_error,
    no_leftovers,
    our_logits,
    refused,
    roundtrip_prompts,
)
from tests.conversion.upcycle_helpers import save_tiny_tokenizer

VOCAB = 320
BASE = {
    "model_type": "motif",
    "architectures": ["MotifForCausalLM"],
    "auto_map": {  # Motif's own folders name these two files (diffmeg's export ships its own under them)
        "AutoConfig": "configuration_motif.MotifConfig",
        "AutoModelForCausalLM": "modeling_motif.MotifForCausalLM",
    },
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "rms_norm_eps": 1e-6,
    "attn_rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,
    "max_position_embeddings": 64,
    "hidden_act": "poly_norm",
    "use_bias": False,
    "k_ratio": 1,
    "use_sliding_window": False,
    "sliding_window": 16,  # only matters with use_sliding_window: imports fine
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
LAYOUTS = {
    # Motif-2.6B: sub-head counts, no head_dim (hidden / num_attention_heads = 8): 4 DIFF heads over 2
    # differential KV heads (GQA)
    "2.6b": {"num_attention_heads": 8, "num_key_value_heads": 4},
    # Motif-2-12.7B's topology (40 / 16 / 8) shrunk: 2 groups of [signal x 4, noise], K1/K2 and V per group
    "12.7b": {"num_attention_heads": 10, "num_key_value_heads": 4, "num_noise_heads": 2, "head_dim": 8},
}


def head_counts(config: dict) -> tuple[int, int, int]:
    """(query heads, key-value heads, d) as Motif's config.json counts them."""
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_attention_heads"], config["num_key_value_heads"], d


def motif_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a Motif model, away from their init (norms in [0.5, 1.5], PolyNorm's weights
    around 1/3 and a bias), lambda vectors of d per layer, fp32."""
    gen = torch.Generator().manual_seed(seed)
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, d = head_counts(config)
    signal = heads - config.get("num_noise_heads", heads // 2)

    def normal(*shape, std=0.08):
        return torch.randn(shape, generator=gen) * std

    def norm(size):
        return torch.empty(size).uniform_(0.5, 1.5, generator=gen)

    tensors = {
        "model.embed_tokens.weight": normal(vocab, hidden, std=0.5),
        "model.norm.weight": norm(hidden),
        "lm_head.weight": normal(vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": normal(heads * d, hidden, std=0.3),
            p + "self_attn.k_proj.weight": normal(kv_heads * d, hidden, std=0.3),
            p + "self_attn.v_proj.weight": normal(kv_heads * d, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, signal * 2 * d),
            p + "self_attn.subln.weight": norm(2 * d),
            p + "mlp.gate_proj.weight": normal(ffn, hidden),
            p + "mlp.up_proj.weight": normal(ffn, hidden),
            p + "mlp.down_proj.weight": normal(hidden, ffn),
            p + "mlp.act_fn.weight": 1 / 3 + normal(3, std=0.1),
            p + "mlp.act_fn.bias": normal(1, std=0.1),
        })  # fmt: skip
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            tensors[p + f"self_attn.{name}"] = normal(d, std=0.3)
    return tensors


def write_motif_folder(directory: Path, layout: str, bf16: bool = False, **changes) -> None:
    """A Motif folder: config.json with Motif's keys, model.safetensors, the tiny tokenizer. `bf16`: the
    weights in bf16 but the lambda vectors in fp32 (as Motif's checkpoints may hold them)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    config = {**BASE, **LAYOUTS[layout], **changes}
    tensors = motif_tensors(config)
    if bf16:
        config["torch_dtype"] = "bfloat16"
        tensors = {k: v if ".lambda_" in k else v.to(torch.bfloat16) for k, v in tensors.items()}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    save_tiny_tokenizer(directory)


def motif_folder(factory, layout: str) -> Path:
    return cached(factory, f"motif-{layout}", lambda path: write_motif_folder(path, layout))


# ------------------------------------------------------------- Motif's forward, from its description


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE over the last dimension of x [s, heads, d], positions 0..s-1."""
    s, d = x.shape[0], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq[None]  # [s, d/2]
    cos, sin = (torch.cat([f(angles)] * 2, -1)[:, None] for f in (torch.cos, torch.sin))
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention_map(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt d): q [s, d], k [s, d] -> [s, s]."""
    s, d = q.shape
    scores = q @ k.T / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


def poly_norm(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    def norm(u):
        return u / torch.sqrt((u * u).mean(-1, keepdim=True) + 1e-6)

    return weight[0] * norm(z**3) + weight[1] * norm(z**2) + weight[2] * norm(z) + bias


def motif_logits(tensors: dict[str, torch.Tensor], config: dict, ids: torch.Tensor) -> torch.Tensor:
    """Motif's forward in float64 for one prompt [s] -> logits [s, V]."""
    t = {k: v.double() for k, v in tensors.items()}
    heads, kv_heads, d = head_counts(config)
    noise, eps, theta = config.get("num_noise_heads"), config["rms_norm_eps"], config["rope_theta"]
    s = ids.numel()
    x = t["model.embed_tokens.weight"][ids]
    for layer in range(config["num_hidden_layers"]):
        w = {
            k[len(f"model.layers.{layer}.") :]: v
            for k, v in t.items()
            if k.startswith(f"model.layers.{layer}.")
        }
        h = rms(x, w["input_layernorm.weight"], eps)
        q = rope((h @ w["self_attn.q_proj.weight"].T).view(s, heads, d), theta)
        k = rope((h @ w["self_attn.k_proj.weight"].T).view(s, kv_heads, d), theta)
        v = (h @ w["self_attn.v_proj.weight"].T).view(s, kv_heads // 2, 2 * d)  # a V of 2d per K1/K2 pair
        lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
        lam = (
            torch.exp(w["self_attn.lambda_q1"] @ w["self_attn.lambda_k1"])
            - torch.exp(w["self_attn.lambda_q2"] @ w["self_attn.lambda_k2"])
            + lambda_init
        )
        outs = []
        if (
            noise is None
        ):  # 2.6B: head i = query sub-heads 2i / 2i+1 over key pair j = i // (heads / kv_heads)
            for i in range(heads // 2):
                j = i // (heads // kv_heads)
                a1 = attention_map(q[:, 2 * i], k[:, 2 * j])
                a2 = attention_map(q[:, 2 * i + 1], k[:, 2 * j + 1])
                outs.append((a1 - lam * a2) @ v[:, j])
        else:  # 12.7B: group j = [signal x r, noise] query heads, key pair 2j / 2j+1, V j
            r = heads // noise - 1
            for j in range(noise):
                group = q[:, j * (r + 1) : (j + 1) * (r + 1)]
                a2 = attention_map(group[:, r], k[:, 2 * j + 1])
                for i in range(r):
                    outs.append((attention_map(group[:, i], k[:, 2 * j]) - lam * a2) @ v[:, j])
        out = rms(torch.stack(outs, 1), w["self_attn.subln.weight"], config["attn_rms_norm_eps"])
        out = out * (1 - lambda_init)
        x = x + out.reshape(s, -1) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"], eps)
        gate = poly_norm(h @ w["mlp.gate_proj.weight"].T, w["mlp.act_fn.weight"], w["mlp.act_fn.bias"])
        x = x + (gate * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return rms(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T


# ------------------------------------------------------------------------------------ the import


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_motif_folder_imports_with_motifs_logits(
    tmp_path_factory, tmp_path, single_rank_parallel_state, layout
):
    """hf-to-mcore of a Motif folder: the checkpoint's fp32 logits are Motif's float64 forward's, its
    args are DIFF V1 with PolyNorm, Motif's lambda_init (and GDA for the 12.7B layout), the folder's
    tokenizer goes with it, and the printed continue-training command names the model's flags."""
    from tests.builders import load_model

    source = motif_folder(tmp_path_factory, layout)
    ckpt = tmp_path / "ckpt"
    proc = convert_ok("hf-to-mcore", "--load", source, "--save", ckpt)
    assert "MotifForCausalLM -> iteration 0" in proc.stdout
    model, args = load_model(str(ckpt))
    assert (args.diff_attention, args.diff_version, args.mlp_activation) == (True, 1, "poly_norm")
    assert str(args.lambda_init) == "motif" and args.norm_epsilon == 1e-6 and args.rotary_base == 5000.0
    assert (args.num_attention_heads, args.num_query_groups, args.kv_channels) == (
        (4, 2, 8) if layout == "2.6b" else (8, 2, 8)
    )
    assert args.num_noise_heads in ((None, 4) if layout == "2.6b" else (2,))
    assert args.tokenizer_type == "HuggingFaceTokenizer" and (ckpt / "tokenizer" / "tokenizer.json").exists()
    command = shlex.split(proc.stdout.strip().splitlines()[-1])
    for flag in ("--lambda-init", "--mlp-activation", *(("--num-noise-heads",) if layout == "12.7b" else ())):
        assert flag in command, command
    assert command[command.index("--lambda-init") + 1] == "motif"
    assert command[command.index("--tokenizer-model") + 1] == str(ckpt / "tokenizer")
    assert command[command.index("--lr") + 1] == "3e-5" and "--train-iters" in command  # the examples

    config = json.loads((source / "config.json").read_text())
    tensors = motif_tensors(config)
    for ids in roundtrip_prompts(VOCAB):
        ours, theirs = our_logits(model, ids), motif_logits(tensors, config, ids)
        assert max_relative_error(ours.double(), theirs) < 1e-5, ids.numel()


def test_bf16_weights_beside_fp32_lambda_vectors(tmp_path, single_rank_parallel_state):
    """A bf16 folder with fp32 lambda vectors imports in bf16 (the checkpoint has one dtype, the
    embedding's); with --dtype fp32 every tensor is the folder's exactly, the lambda vectors unrounded."""
    from safetensors.torch import load_file

    from diffmeg.conversion.checkpoint_io import McoreCheckpointReader
    from tests.builders import load_model

    source = tmp_path / "motif-bf16"
    write_motif_folder(source, "12.7b", bf16=True)
    stored = load_file(str(source / "model.safetensors"))
    convert_ok("hf-to-mcore", "--load", source, "--save", tmp_path / "bf16")
    assert McoreCheckpointReader(str(tmp_path / "bf16")).dtype == torch.bfloat16
    convert_ok("hf-to-mcore", "--load", source, "--save", tmp_path / "fp32", "--dtype", "fp32")
    model, _ = load_model(str(tmp_path / "fp32"))
    params = dict(model.named_parameters())
    for i in range(BASE["num_hidden_layers"]):
        core = f"decoder.layers.{i}.self_attention.core_attention."
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            theirs = stored[f"model.layers.{i}.self_attn.{name}"]
            assert theirs.dtype == torch.float32 and torch.equal(params[core + name], theirs)
        subln = stored[f"model.layers.{i}.self_attn.subln.weight"]
        assert subln.dtype == torch.bfloat16 and torch.equal(params[core + "head_norm.weight"], subln.float())


# ----------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window: true"),
        ({"k_ratio": 2}, "k_ratio: 2 is not supported"),
        ({"use_bias": True}, "use_bias: true is not supported"),
        ({"attention_bias": True}, "attention_bias: true is not supported"),
        ({"mlp_bias": True}, "mlp_bias: true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
        ({"attn_rms_norm_eps": 1e-6}, "attn_rms_norm_eps: 1e-06 differs from our head-norm epsilon"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 must be 2 x num_noise_heads (4)"),
        ({"head_dim": None}, "head_dim is required with num_noise_heads"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE type 'linear'"),
    ],
)
def test_what_our_model_cannot_represent_is_refused_by_key(
    tmp_path_factory, tmp_path, capsys, single_rank_parallel_state, changes, message
):
    folder = hf_folder_variant(motif_folder(tmp_path_factory, "12.7b"), tmp_path / "bad", **changes)
    err = refused(capsys, "convert_checkpoint", "hf-to-mcore", "--load", folder, "--save", tmp_path / "ckpt")
    assert message in err, err
    assert no_leftovers(tmp_path / "ckpt")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_polynorm_v1_checkpoint_is_motifs_layout_only_with_motifs_lambda_init(layout):
    """The arguments an import records give back its layout; with another lambda_init, a one-line refusal
    (no Hugging Face format holds a DIFF V1 model with PolyNorm but Motif's)."""
    import argparse

    from diffmeg.conversion.hf_config import layout_from_args, layout_from_hf_config
    from diffmeg.errors import DiffmegError

    motif = layout_from_hf_config({**BASE, **LAYOUTS[layout]})
    args = argparse.Namespace(
        diff_attention=True,
        diff_version=1,
        mlp_activation="poly_norm",
        lambda_init="motif",
        num_layers=motif.num_layers,
        hidden_size=motif.hidden_size,
        ffn_hidden_size=motif.ffn_hidden_size,
        num_attention_heads=motif.num_heads,
        num_query_groups=motif.num_kv_heads,
        num_noise_heads=motif.num_noise_heads,
        kv_channels=motif.head_dim,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rotary_base=5000.0,
        norm_epsilon=1e-6,
    )
    assert layout_from_args(args) == motif
    args.lambda_init = "exp"
    with pytest.raises(DiffmegError, match="no Hugging Face format but Motif's"):
        layout_from_args(args)


def test_odd_sub_head_counts_of_the_paired_layout_are_refused(tmp_path_factory, tmp_path, capsys):
    folder = hf_folder_variant(
        motif_folder(tmp_path_factory, "2.6b"), tmp_path / "bad", num_key_value_heads=3
    )
    err = refused(capsys, "convert_checkpoint", "hf-to-mcore", "--load", folder, "--save", tmp_path / "ckpt")
    assert "num_key_value_heads (3) count sub-heads in pairs" in err, err


@pytest.mark.slow
def test_the_printed_command_continues_training_at_tp1_and_tp2(tmp_path_factory, tmp_path):
    """The continue-training line hf-to-mcore prints runs as printed (here with the training flags given
    after `--`): one step of the imported 12.7B-layout model on the builtin corpus in the folder's
    tokenizer. The same command at TP=2 (the grouped layout split over ranks, one group of [signal x 4,
    noise] and its K1/K2 pair a rank) starts from the same loss, and so does `--use-checkpoint-args`."""
    import subprocess

    from tests.distributed.runner import REPO_ROOT, job_env, launch_cmd, read_losses

    ckpt = tmp_path / "ckpt"
    training = ["--lr", "1e-4", "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "1"]
    metrics = ["--metrics-file", str(tmp_path / "tp1.jsonl")]
    proc = convert_ok("hf-to-mcore", "--load", motif_folder(tmp_path_factory, "12.7b"), "--save", ckpt, "--",
                      *training, *metrics)  # fmt: skip
    command = shlex.split(proc.stdout.strip().splitlines()[-1])
    assert command[:2] == ["python", "pretrain_diff.py"] and "--finetune" in command
    assert command[command.index("--lr") + 1] == "1e-4" and command.count("--lr") == 1
    tp2 = ["--tensor-model-parallel-size", "2", "--metrics-file", str(tmp_path / "tp2.jsonl")]
    # --use-checkpoint-args reads the model (PolyNorm, Motif's lambda_init, the noise heads) from args.json
    from_args = ["pretrain_diff.py", "--use-checkpoint-args", "--load", str(ckpt), "--finetune", *training]
    from_args += ["--metrics-file", str(tmp_path / "from-args.jsonl")]
    runs = (
        (1, [sys.executable, *command[1:]]),
        (2, launch_cmd(2, [*command[1:], *tp2])),
        (1, [sys.executable, *from_args]),
    )
    for nproc, cmd in runs:
        run = subprocess.run(cmd, cwd=REPO_ROOT, env=job_env(tmp_path, nproc), capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"loaded checkpoint from {ckpt}" in run.stdout
    loss = read_losses(tmp_path, "tp1")[1]
    assert math.isfinite(loss) and read_losses(tmp_path, "tp2")[1] == pytest.approx(loss, rel=1e-5)
    assert read_losses(tmp_path, "from-args")[1] == loss
