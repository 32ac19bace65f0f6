"""Named model and training recipes: the paper's table (DESIGN.md), plus CPU-sized `*-tiny`.

A preset is a flat dict of `pretrain_diff.py` argument names to values; explicit command-line flags
override it. `--num-attention-heads` counts *differential* heads for DIFF models (the paper's count) and
ordinary heads for Transformer baselines; the baselines have twice the heads of size 128, so
parameters and FLOPs outside the attention core match exactly. DIFF V2 (`diff2-*`) has the layers,
hidden and FFN sizes of both and the Transformer's h heads of d as its output heads (2h query heads,
h KV heads, plus the lambda projection). Grouped differential attention (`gda-*`, Motif-3's form) is DIFF
V2 with those h signal heads sharing h / 4 noise heads (4:1) over h / 4 KV heads (a KV head per group):
h + h/4 query heads.
"""

from __future__ import annotations

import math

from diffmeg.errors import DiffmegError

PADDED_VOCAB_SIZE = 100288  # cl100k_base (100277 ids) padded to a multiple of 64
HEAD_DIM = 128
GDA_RATIO = 4
"""Signal heads per noise head of the gda-* presets (Motif-3's 64:16; the GDA paper's best ratios 3-4:1)."""


def swiglu_ffn_size(hidden: int) -> int:
    """8/3 h rounded down to a multiple of 64, as Megatron-LM sizes SwiGLU when no FFN size is given."""
    return int(4 * hidden * 2 / 3 / 64) * 64


def _tokens_to_iters(tokens: float, global_batch: int, seq: int) -> int:
    return math.ceil(tokens / (global_batch * seq))


def _model(layers: int, hidden: int, diff_heads: int, ffn: int, seq: int) -> dict:
    return {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": diff_heads,
        "kv_channels": hidden // (2 * diff_heads),
        "ffn_hidden_size": ffn,
        "seq_length": seq,
        "max_position_embeddings": seq,
    }


# The 3B run: 1T tokens, 4M-token batches (1024 x 4096), 1000 warmup, linear 3.2e-4 -> 1.28e-5.
_RUN_3B = {
    "global_batch_size": 1024,
    "lr": 3.2e-4,
    "min_lr": 1.28e-5,
    "lr_warmup_iters": 1000,
    "lr_decay_style": "linear",
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "weight_decay": 0.1,
    "train_iters": _tokens_to_iters(1e12, 1024, 4096),
    "train_tokens": int(1e12),
}

# The scaling sweep: 40K steps of 0.25M tokens (128 x 2048), 375 warmup, linear decay.
_RUN_SCALING = {
    "global_batch_size": 128,
    "lr_warmup_iters": 375,
    "lr_decay_style": "linear",
    "min_lr": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.98,
    "weight_decay": 0.05,
    "train_iters": 40000,
}

_SCALING = {  # name: (layers, hidden, DIFF heads, lr)
    "830m": (24, 1536, 8, 1.5e-4),  # the table gives 8 heads: d = 1536 / 16 = 96 here
    "1.4b": (24, 2048, 8, 1.5e-4),
    "2.8b": (32, 2560, 10, 1.5e-4),
    "6.8b": (32, 4096, 16, 7.5e-5),
    "13b": (40, 5120, 20, 7.5e-5),
}


# Motif Technologies' open DIFF checkpoints (Motif-2.6B: DIFF V1; Motif-2-12.7B: V1-style grouped differential
# attention), both with the PolyNorm MLP and Motif's lambda_init schedule. A `motif-*` preset is for continued
# pretraining of an import (`convert_checkpoint.py hf-to-mcore --load MOTIF_FOLDER`): the model's shape as
# hf-to-mcore derives it from the published config.json (heads counted as pretrain_diff.py counts them, see
# diffmeg.conversion.layout.MotifLayout) and a continued-pretraining recipe of ours (Motif pretrained with
# MuonClip, which diffmeg does not have; AdamW here). The tokenizer is the one shipped with the folder, kept
# by the import (`--tokenizer-type HuggingFaceTokenizer --tokenizer-model CKPT/tokenizer`), so the preset
# names none. Run it with `--use-checkpoint-args --load CKPT --finetune` (slurm/motif_continue.sh): the
# import's args.json then gives every shape value, rotary base and epsilon, and where a value below
# differs (those marked unconfirmed) the checkpoint's wins; the preset alone sizes a --dry-run.
# Sources (read 2026-12-02): the head layout from notes/motif_format.md's readers (vLLM's motif.py, the MLX
# port); 12.7B's hidden 4096, 40 layers, FFN 16384, 40 query / 16 KV heads of 128, 8 noise heads from the
# MLX port's (junhoyeo/mlx-motif) test config; its rope_theta 1e6 and untied lm_head from a llama.cpp port's
# notes on Motif-2-12.7B-Reasoning's config.json and tensor list.
_MOTIF_VOCAB = 219520
"""Unconfirmed: no public file read states it. With the confirmed 12.7B shape it gives 12.70B parameters
(untied), and with the 2.6B shape below 2.60B (tied); the MLX port's test config says 128000 (11.95B)."""
_MOTIF_RECIPE = {
    # ours, for continuing a converged checkpoint: short warmup, low peak, 2M-token batches of 4096
    "seq_length": 4096,
    "global_batch_size": 512,
    "lr": 3e-5,
    "min_lr": 3e-6,
    "lr_warmup_iters": 100,
    "lr_decay_style": "cosine",
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "weight_decay": 0.1,
    "train_iters": _tokens_to_iters(2e10, 512, 4096),
    "train_tokens": int(2e10),
}


def _motif_presets() -> dict[str, dict]:
    motif = {"diff_attention": True, "diff_version": 1, "lambda_init": "motif", "mlp_activation": "poly_norm"}
    return {
        # config.json: 16 / 16 sub-heads (8 DIFF heads over 8 K1/K2 pairs), d = hidden / 16. Unconfirmed:
        # hidden 2048, FFN 8192, 32 layers, tied embeddings (what makes 2.60B), rope_theta and rms_norm_eps
        # (Motif's config-class defaults 10000 and 1e-6).
        "motif-2.6b": {
            **_MOTIF_RECIPE,
            **motif,
            "num_layers": 32,
            "hidden_size": 2048,
            "ffn_hidden_size": 8192,
            "num_attention_heads": 8,
            "num_query_groups": 8,
            "kv_channels": 128,
            "vocab_size": _MOTIF_VOCAB,
            "max_position_embeddings": 4096,  # unconfirmed: the recipe's sequence (RoPE has no table)
            "rotary_base": 10000.0,
            "norm_epsilon": 1e-6,
            "tie_embeddings_and_output_weights": True,
        },
        # config.json: 40 query heads = 8 groups of [signal x 4, noise], 16 K heads (a K1/K2 pair a group),
        # head_dim 128 -> 32 signal heads over 8 differential KV heads, 8 noise heads. Unconfirmed:
        # rms_norm_eps (Motif's config-class default 1e-6), max_position_embeddings.
        "motif-12.7b": {
            **_MOTIF_RECIPE,
            **motif,
            "num_layers": 40,
            "hidden_size": 4096,
            "ffn_hidden_size": 16384,
            "num_attention_heads": 32,
            "num_query_groups": 8,
            "group_query_attention": True,
            "num_noise_heads": 8,
            "kv_channels": 128,
            "vocab_size": _MOTIF_VOCAB,
            "max_position_embeddings": 4096,  # unconfirmed: the recipe's sequence (RoPE has no table)
            "rotary_base": 1000000.0,
            "norm_epsilon": 1e-6,
        },
    }


def _build_presets() -> dict[str, dict]:
    presets: dict[str, dict] = {}
    diff = {
        "3b": {**_model(28, 3072, 12, 8192, 4096), **_RUN_3B},
        "tiny": {
            **_model(4, 256, 4, swiglu_ffn_size(256), 256),
            # 1024 tokens a step keeps a CPU step near 1.5 s with the full 100288-entry vocabulary.
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "min_lr": 1e-4,
            "lr_warmup_iters": 20,
            "lr_decay_style": "cosine",
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "weight_decay": 0.1,
            "train_iters": 300,
            "eval_interval": 100,
            "eval_iters": 4,
            "log_interval": 10,
        },
    }
    for size, (layers, hidden, heads, lr) in _SCALING.items():
        diff[size] = {
            **_model(layers, hidden, heads, swiglu_ffn_size(hidden), 2048),
            **_RUN_SCALING,
            "lr": lr,
        }
    for size, recipe in diff.items():
        presets[f"diff-{size}"] = {**recipe, "diff_attention": True}
        baseline = dict(recipe, diff_attention=False, num_attention_heads=2 * recipe["num_attention_heads"])
        presets[f"transformer-{size}"] = baseline
        presets[f"diff2-{size}"] = dict(baseline, diff_attention=True, diff_version=2)
        groups = baseline["num_attention_heads"] // GDA_RATIO
        presets[f"gda-{size}"] = dict(
            presets[f"diff2-{size}"], num_noise_heads=groups, num_query_groups=groups
        )
    # The 64K extension of the 3B run: 1.5B tokens of 64 x 65536-token batches (4M tokens), RoPE theta
    # 640000, lr 8e-5, started from the 3B checkpoint (--pretrained-checkpoint) on the upsampled blend.
    # Layout for H100x8 nodes (the Slurm recipe): TP 2 x CP 2, sequence parallel, full recompute, the
    # distributed optimizer: ~33 GiB per GPU by the dry-run plan (selective recompute: ~102 GiB).
    for arch in ("diff", "diff2", "gda", "transformer"):
        presets[f"{arch}-3b-64k"] = {
            **presets[f"{arch}-3b"],
            "seq_length": 65536,
            "max_position_embeddings": 65536,
            "rotary_base": 640000.0,
            "global_batch_size": 64,
            "lr": 8e-5,
            "min_lr": 8e-6,
            "lr_warmup_iters": 20,
            "lr_decay_style": "cosine",
            "train_iters": _tokens_to_iters(1.5e9, 64, 65536),
            "train_tokens": int(1.5e9),
        }
    presets.update(_motif_presets())
    presets["diff-13.1b"] = presets["diff-13b"]
    presets["transformer-13.1b"] = presets["transformer-13b"]
    presets["diff2-13.1b"] = presets["diff2-13b"]
    presets["gda-13.1b"] = presets["gda-13b"]
    for recipe in presets.values():
        recipe.setdefault("vocab_size", PADDED_VOCAB_SIZE)
    return presets


PRESETS: dict[str, dict] = _build_presets()


def get_preset(name: str) -> dict:
    """A copy of the named recipe, or a one-line error listing the known names."""
    if name not in PRESETS:
        raise DiffmegError(f"unknown model preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])
