"""config.json for DiffLlama / Llama from a checkpoint's arguments, and back (pure functions on plain values).

A DIFF checkpoint maps to transformers' DiffLlama, the Transformer baseline (`--no-diff-attention`) to
transformers' Llama, DIFF V2 (`--diff-version 2`) to diffmeg's `Diff2ForCausalLM` (`modeling_diff2.py`,
shipped in the folder and named in config.json's `auto_map` and `architectures`) over transformers'
LlamaConfig (`model_type` "llama": config.json and the tokenizer load without remote code; the model class
needs `trust_remote_code=True`). What they can express, checked before anything is written:
- RMSNorm with one epsilon (`rms_norm_eps`), SwiGLU (silu), no biases, non-interleaved RoPE without
  scaling; a tied or untied output layer (`tie_word_embeddings` <-> `--tie-embeddings-and-output-weights`).
- DiffLlama: lambda_init only as the paper's depth schedule `0.8 - 0.6 exp(-0.3 l)` with the 0-based
  layer index (transformers computes it from `layer_idx`; ours uses megatron-core's 1-based layer
  number minus one, the same values); a constant `--lambda-init` has no DiffLlama equivalent. Its
  weightless head norm shares `rms_norm_eps`, so our head-norm epsilon must equal `--norm-epsilon`.
- Grouped differential attention (`--num-noise-heads n` < h): DIFF V2's export carries it as config.json's
  `num_noise_heads` (Motif's name; absent for the 1:1 model, whose export is unchanged). V1-style GDA has
  no Hugging Face format yet (DiffLlama pairs every head with a noise head of its own): refused.
- Motif (`model_type` "motif", Motif Technologies' format; exported with diffmeg's own remote code,
  `configuration_motif.py` and `modeling_motif.py`, named in `auto_map` as Motif's are): DIFF V1 with PolyNorm
  (`hidden_act` poly_norm), Motif's lambda_init schedule and `subln` (our head norm, epsilon
  `attn_rms_norm_eps`, which must be our fixed head-norm epsilon); the 12.7B layout's `num_noise_heads` is our
  V1 grouped differential attention with one KV head per group (`k_ratio` 1). Sliding windows, other
  `k_ratio`s and biases are refused; keys that only matter when enabled (a `sliding_window` beside
  `use_sliding_window: false`) are not. An import records the folder's config.json in its args
  (`SOURCE_CONFIG_ARG`), so the export writes those keys back as they were (`motif_config_dict`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from diffmeg.conversion.layout import Diff2Layout, DiffLayout, LlamaLayout, ModelLayout, MotifLayout
from diffmeg.errors import DiffmegError

LAYOUTS = {layout.model_type: layout for layout in (DiffLayout, LlamaLayout, MotifLayout)}
"""The Hugging Face model types we convert, by `model_type` (DIFF V2 is a Llama config: `is_diff2_config`)."""
OLD_DIFF2_MODEL_TYPE = "diffmeg_diff2"
"""DIFF V2's `model_type` in exports written up to 2026-11-27, whose config class was remote code too."""
REMOTE_CODE_FILE = "modeling_diff2.py"
"""DIFF V2's modeling file (diffmeg/conversion/modeling_diff2.py), copied into every V2 export."""
AUTO_MAP = {"AutoModelForCausalLM": "modeling_diff2.Diff2ForCausalLM"}
"""The one class of a DIFF V2 export that is remote code (its config is transformers' LlamaConfig)."""
MOTIF_REMOTE_CODE_FILES = ("configuration_motif.py", "modeling_motif.py")
"""diffmeg's own Motif config and model classes (diffmeg/conversion/), copied into every Motif export."""
MOTIF_AUTO_MAP = {
    "AutoConfig": "configuration_motif.MotifConfig",
    "AutoModelForCausalLM": "modeling_motif.MotifForCausalLM",
}
"""A Motif export's remote code: the module and class names Motif's own folders give, so the entry of a
Motif folder comes back unchanged."""
SOURCE_CONFIG_ARG = "hf_source_config"
"""The args.json entry where a Motif import keeps the folder's config.json as it was (for the export)."""


def transformers_config_class(layout: ModelLayout | type[ModelLayout]) -> type:
    """transformers' config class of this layout's `model_type` (`DiffLlamaConfig`, or `LlamaConfig` for
    Llama and DIFF V2; imports transformers). Motif's config class is remote code: `motif_config_dict`."""
    from transformers import CONFIG_MAPPING

    if layout is MotifLayout or isinstance(layout, MotifLayout):
        raise DiffmegError("a Motif config.json is written by motif_config_dict, not a transformers class")
    return CONFIG_MAPPING[layout.model_type]


def default_head_norm_eps() -> float:
    """The head-norm epsilon our model uses when the arguments do not set one (the config default)."""
    from diffmeg.config import DiffTransformerConfig

    return next(f.default for f in dataclasses.fields(DiffTransformerConfig) if f.name == "head_norm_eps")


def _same_eps(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def _check_diff_args(args: argparse.Namespace) -> None:
    lambda_init = getattr(args, "lambda_init", "exp")
    if str(lambda_init) != "exp":
        raise DiffmegError(
            f"DiffLlama cannot express a constant lambda_init ({lambda_init}): transformers always uses "
            f"0.8 - 0.6 exp(-0.3 layer_idx); only checkpoints trained with --lambda-init exp can be exported"
        )
    head_eps = float(getattr(args, "head_norm_eps", None) or default_head_norm_eps())
    if not _same_eps(head_eps, float(args.norm_epsilon)):
        raise DiffmegError(
            f"DiffLlama uses one epsilon for every RMSNorm, but this model's head norm uses {head_eps} and "
            f"its layer norms {args.norm_epsilon}"
        )


def layout_from_args(args: argparse.Namespace) -> ModelLayout:
    """The layout of a `pretrain_diff.py` checkpoint (DIFF or the Transformer baseline), refusing what
    DiffLlama / Llama cannot express."""
    if getattr(args, "position_embedding_type", "rope") != "rope":
        raise DiffmegError(
            f"Hugging Face Llama models need RoPE, this model uses {args.position_embedding_type}"
        )
    diff = bool(getattr(args, "diff_attention", True))
    v2 = diff and int(getattr(args, "diff_version", 1)) == 2
    heads, noise = int(args.num_attention_heads), getattr(args, "num_noise_heads", None)  # old args: None
    grouped = diff and noise is not None and int(noise) != heads
    if diff and not v2 and getattr(args, "mlp_activation", "swiglu") == "poly_norm":
        return _motif_layout_from_args(args, None if not grouped else int(noise))
    if diff and not v2:
        if grouped:
            raise DiffmegError(
                f"V1-style grouped differential attention (--num-noise-heads {noise} for {heads} heads) has "
                f"no Hugging Face export with a SwiGLU MLP: DiffLlama gives each head a noise head of its "
                f"own, and Motif's format, which holds grouped V1 models, has the PolyNorm MLP and Motif's "
                f"lambda_init (--mlp-activation poly_norm --lambda-init motif); V2-style ones "
                f"(--diff-version 2) export"
            )
        _check_diff_args(args)
    layout = Diff2Layout if v2 else DiffLayout if diff else LlamaLayout
    grouping = {"num_noise_heads": int(noise)} if v2 and grouped else {}
    return layout(**_layout_sizes(args), **grouping)


def _layout_sizes(args: argparse.Namespace) -> dict[str, object]:
    """The sizes every layout takes, from a checkpoint's saved arguments."""
    return dict(
        num_layers=int(args.num_layers),
        hidden_size=int(args.hidden_size),
        ffn_hidden_size=int(args.ffn_hidden_size),
        num_heads=int(args.num_attention_heads),
        num_kv_heads=int(args.num_query_groups),
        head_dim=int(args.kv_channels),
        vocab_size=int(args.vocab_size),
        max_position_embeddings=int(args.max_position_embeddings),
        rotary_base=float(args.rotary_base),
        norm_eps=float(args.norm_epsilon),
        tied=bool(getattr(args, "tie_embeddings_and_output_weights", False)),  # absent from old args: untied
    )


def _motif_layout_from_args(args: argparse.Namespace, noise: int | None) -> MotifLayout:
    """A DIFF V1 checkpoint with PolyNorm as Motif's layout (what an import of a Motif folder records)."""
    if str(getattr(args, "lambda_init", "exp")) != "motif":
        raise DiffmegError(
            f"a DIFF V1 model with PolyNorm (--mlp-activation poly_norm) has no Hugging Face format but "
            f"Motif's, whose lambda_init is Motif's schedule (--lambda-init motif); this one uses "
            f"--lambda-init {args.lambda_init}"
        )
    return MotifLayout(**_layout_sizes(args), num_noise_heads=noise)


def _llama_keys(layout: ModelLayout, hidden_act: str, initializer_range: float) -> dict[str, Any]:
    """The Llama-family shape keys every exported config.json holds, in their usual order (the DIFF
    formats count sub-heads: `hf_attention_heads`)."""
    heads, kv_heads = layout.hf_attention_heads()
    return {
        "vocab_size": layout.vocab_size,
        "hidden_size": layout.hidden_size,
        "intermediate_size": layout.ffn_hidden_size,
        "num_hidden_layers": layout.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": layout.head_dim,
        "hidden_act": hidden_act,
        "max_position_embeddings": layout.max_position_embeddings,
        "initializer_range": initializer_range,
        "rms_norm_eps": layout.norm_eps,
    }


def hf_config_dict(
    layout: ModelLayout,
    *,
    dtype: str,
    bos_token_id: int | None,
    eos_token_id: int | None,
    initializer_range: float = 0.02,
    lambda_std: float = 0.1,
) -> dict[str, Any]:
    """Keyword arguments of `transformers.DiffLlamaConfig` / `LlamaConfig` for this layout (`dtype` like
    "bfloat16"; `lambda_std` only for DiffLlama). Motif's: `motif_config_dict`."""
    if isinstance(layout, MotifLayout):
        raise DiffmegError("a Motif config.json is written by motif_config_dict")
    config = {
        "architectures": [layout.architecture],
        **_llama_keys(layout, "silu", initializer_range),
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "tie_word_embeddings": layout.tied,
        "rope_parameters": {"rope_type": "default", "rope_theta": layout.rotary_base},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": dtype,
    }
    if isinstance(layout, DiffLayout):
        config["lambda_std_dev"] = lambda_std
    else:
        config["mlp_bias"] = False
    if isinstance(layout, Diff2Layout):
        config["auto_map"] = dict(AUTO_MAP)
        if layout.num_noise_heads is not None:  # grouped: the 1:1 model's config has no such field
            config["num_noise_heads"] = layout.num_noise_heads
    return config


def generation_config_dict(eos_token_id: int | None, bos_token_id: int | None) -> dict[str, Any]:
    """generation_config.json: stop at the end-of-document token; pad with it (tiktoken has no pad)."""
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id}


def _rope_theta(config: Mapping[str, Any]) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise DiffmegError(
            f"RoPE type {rope_type!r} (scaled RoPE) is not supported by pretrain_diff.py; only plain RoPE"
        )
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise DiffmegError("config.json gives no rope_theta")
    return float(theta)


def is_diff2_config(config: Mapping[str, Any]) -> bool:
    """A DIFF V2 config.json: Llama's config naming diffmeg's model class (or an older export's own type)."""
    architectures = config.get("architectures") or []
    return Diff2Layout.architecture in architectures or config.get("model_type") == OLD_DIFF2_MODEL_TYPE


def check_model_type(config: Mapping[str, Any], where: str = "config.json") -> type[ModelLayout]:
    """The layout class of a config.json (its `model_type`; DIFF V2 by its architecture), or a one-line
    refusal."""
    if is_diff2_config(config):
        return Diff2Layout
    model_type = config.get("model_type")
    if model_type not in LAYOUTS:
        known = " or ".join(f"{t!r} ({c.architecture})" for t, c in LAYOUTS.items())
        raise DiffmegError(
            f"{where} has model_type {model_type!r}; only {known} models are supported, and DIFF V2 "
            f"({Diff2Layout.architecture})"
        )
    return LAYOUTS[model_type]


def layout_from_hf_config(config: Mapping[str, Any]) -> ModelLayout:
    """The layout of a DiffLlama, Llama or DIFF V2 config.json (`tie_word_embeddings` included), refusing
    what our model cannot express."""
    layout_class = check_model_type(config)
    if layout_class is MotifLayout:
        return _motif_layout(config)
    if config.get("hidden_act", "silu") != "silu":
        raise DiffmegError(f"hidden_act {config['hidden_act']!r} is not supported; our MLP is SwiGLU (silu)")
    if config.get("attention_bias", False) or config.get("mlp_bias", False):
        raise DiffmegError("attention or MLP biases are not supported; our linear layers have no bias")
    heads, kv_heads = int(config["num_attention_heads"]), config.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else int(kv_heads)
    eps = float(config.get("rms_norm_eps", 1e-5))  # DiffLlamaConfig's default
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim") or hidden // heads
    if layout_class is DiffLayout:
        if heads % 2 or kv_heads % 2:
            raise DiffmegError(
                f"DiffLlama pairs heads: num_attention_heads ({heads}) and num_key_value_heads ({kv_heads}) "
                f"must be even"
            )
        head_eps = default_head_norm_eps()
        if not _same_eps(eps, head_eps):
            raise DiffmegError(
                f"rms_norm_eps {eps} differs from our head-norm epsilon {head_eps} (fixed in "
                f"DiffTransformerConfig): the head norm of this model cannot be reproduced"
            )
        heads, kv_heads = heads // 2, kv_heads // 2
    grouping = {}
    if layout_class is Diff2Layout and config.get("num_noise_heads") is not None:
        grouping["num_noise_heads"] = int(config["num_noise_heads"])  # absent: the 1:1 DIFF V2
    return layout_class(
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(config["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        rotary_base=_rope_theta(config),
        norm_eps=eps,
        tied=bool(config.get("tie_word_embeddings", False)),
        **grouping,
    )


MOTIF_DEFAULTS = {
    "hidden_act": "poly_norm",
    "rms_norm_eps": 1e-6,
    "attn_rms_norm_eps": 1e-5,
    "k_ratio": 1,
    "use_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
}
"""What Motif's own config class (remote code, never run here) assumes for a key config.json leaves out."""


def _motif_refusal(config: Mapping[str, Any]) -> str | None:
    """Why a Motif config.json cannot be our model (naming the key), or None."""
    value = {**MOTIF_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    head_eps = default_head_norm_eps()
    if value["use_sliding_window"]:
        return "use_sliding_window: true (sliding-window attention) is not supported; ours is full causal"
    if int(value["k_ratio"]) != 1:
        return (
            f"k_ratio: {value['k_ratio']} is not supported; only Motif's k_ratio 1 (a K1/K2 pair per group) "
            f"is our grouped differential attention"
        )
    for key in ("use_bias", "attention_bias", "mlp_bias"):
        if value.get(key):
            return f"{key}: true is not supported; our linear layers have no bias"
    if value["hidden_act"] != "poly_norm":
        return f"hidden_act: {value['hidden_act']!r} is not supported; only Motif's PolyNorm ('poly_norm')"
    if not _same_eps(float(value["attn_rms_norm_eps"]), head_eps):
        return (
            f"attn_rms_norm_eps: {value['attn_rms_norm_eps']} differs from our head-norm epsilon {head_eps} "
            f"(fixed in DiffTransformerConfig): the subln of this model cannot be reproduced"
        )
    return None


def _motif_layout(config: Mapping[str, Any]) -> MotifLayout:
    """The layout of a Motif config.json (2.6B: sub-head counts; 12.7B: `num_noise_heads`), refusing
    in one line, by its key, what our model cannot express."""
    refusal = _motif_refusal(config)
    if refusal is not None:
        raise DiffmegError(f"Motif config.json: {refusal}")
    value = {**MOTIF_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    heads, hidden = int(value["num_attention_heads"]), int(value["hidden_size"])
    kv_heads = int(value.get("num_key_value_heads") or heads)
    noise = value.get("num_noise_heads")
    if noise is None:  # 2.6B: the counts are sub-heads, paired 2i / 2i+1
        if heads % 2 or kv_heads % 2:
            raise DiffmegError(
                f"Motif config.json: num_attention_heads ({heads}) and num_key_value_heads ({kv_heads}) "
                f"count sub-heads in pairs and must be even"
            )
        head_dim = int(value.get("head_dim") or hidden // heads)
        signal, groups = heads // 2, kv_heads // 2
    else:
        noise = int(noise)
        if value.get("head_dim") is None:
            raise DiffmegError("Motif config.json: head_dim is required with num_noise_heads")
        if kv_heads != 2 * noise:
            raise DiffmegError(
                f"Motif config.json: num_key_value_heads {kv_heads} must be 2 x num_noise_heads "
                f"({2 * noise}): one K1/K2 pair per group"
            )
        if heads <= noise or heads % noise:
            raise DiffmegError(
                f"Motif config.json: num_attention_heads {heads} must be (r + 1) x num_noise_heads {noise} "
                f"(r signal heads and one noise head per group)"
            )
        head_dim, signal, groups = int(value["head_dim"]), heads - noise, noise
    return MotifLayout(
        num_layers=int(value["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(value["intermediate_size"]),
        num_heads=signal,
        num_kv_heads=groups,
        head_dim=head_dim,
        vocab_size=int(value["vocab_size"]),
        max_position_embeddings=int(value["max_position_embeddings"]),
        rotary_base=_rope_theta(value),
        norm_eps=float(value["rms_norm_eps"]),
        tied=bool(value["tie_word_embeddings"]),
        num_noise_heads=noise,
    )


def motif_config_dict(
    layout: MotifLayout,
    *,
    dtype: str,
    bos_token_id: int | None,
    eos_token_id: int | None,
    initializer_range: float = 0.02,
    head_norm_eps: float | None = None,
    source: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json of a Motif export: Motif's keys with this model's values (sub-head counts as Motif
    counts them, `num_noise_heads` for the 12.7B layout, `attn_rms_norm_eps` our head-norm epsilon).

    `source`: the config.json the checkpoint was imported from (`SOURCE_CONFIG_ARG`). Its keys come back in
    its order and with its values wherever they equal the model's (`10000` stays an int beside our float),
    keys we do not read (a `sliding_window` beside `use_sliding_window: false`, Motif's own extras) as they
    were, and a key it left out is not added where Motif's default already gives the model's value. So an
    import's export is its folder's config.json; a bos / eos id the tokenizer does not give stays the
    source's."""
    heads, _ = layout.hf_attention_heads()
    d = layout.head_dim
    values: dict[str, Any] = {
        "model_type": MotifLayout.model_type,
        "architectures": [MotifLayout.architecture],
        "auto_map": dict(MOTIF_AUTO_MAP),
        **_llama_keys(layout, "poly_norm", initializer_range),
        "attn_rms_norm_eps": default_head_norm_eps() if head_norm_eps is None else head_norm_eps,
        "rope_theta": layout.rotary_base,
        "k_ratio": 1,
        "use_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": layout.tied,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }
    if layout.num_noise_heads is not None:
        values["num_noise_heads"] = layout.num_noise_heads
    elif layout.hidden_size == heads * d:  # the 2.6B layout's d is hidden / num_attention_heads
        del values["head_dim"]
    if source is None:
        return values
    config = dict(source)
    implied = {  # what the import read where the source gave nothing
        **MOTIF_DEFAULTS,
        "num_key_value_heads": source.get("num_attention_heads"),
        "head_dim": d,
        "initializer_range": 0.02,
    }
    if "rope_theta" not in source and _rope_theta({**MOTIF_DEFAULTS, **source}) == layout.rotary_base:
        implied["rope_theta"] = layout.rotary_base  # given as rope_parameters / rope_scaling: kept there
    if "torch_dtype" not in source and "dtype" in source:  # a transformers 5 save names it `dtype`
        values["dtype"] = values.pop("torch_dtype")
    for key, value in values.items():
        same = key in config and config[key] == value
        if same and isinstance(config[key], bool) == isinstance(value, bool):  # True == 1, not the same
            continue
        if key not in config and implied.get(key, object()) == value:
            continue
        if key.endswith("_token_id") and value is None and key in config:
            continue  # the tokenizer does not say: the source's id
        config[key] = value
    return config


def pretrain_flags(layout: ModelLayout) -> list[str]:
    """The `pretrain_diff.py` model flags that build this layout (heads as the CLI counts them)."""
    flags = [
        "--num-layers", str(layout.num_layers),
        "--hidden-size", str(layout.hidden_size),
        "--ffn-hidden-size", str(layout.ffn_hidden_size),
        "--num-attention-heads", str(layout.num_heads),
        "--num-query-groups", str(layout.num_kv_heads),
        "--kv-channels", str(layout.head_dim),
        "--max-position-embeddings", str(layout.max_position_embeddings),
        "--vocab-size", str(layout.vocab_size),
        "--rotary-base", repr(layout.rotary_base),
        "--norm-epsilon", repr(layout.norm_eps),
    ]  # fmt: skip
    if isinstance(layout, MotifLayout):
        flags += ["--lambda-init", "motif", "--mlp-activation", "poly_norm"]
        if layout.num_noise_heads is not None:
            flags += ["--num-noise-heads", str(layout.num_noise_heads)]
    elif isinstance(layout, DiffLayout):
        flags += ["--lambda-init", "exp"]
    elif isinstance(layout, Diff2Layout):
        flags += ["--diff-attention", "--diff-version", "2"]
        if layout.num_noise_heads is not None:
            flags += ["--num-noise-heads", str(layout.num_noise_heads)]
    else:
        flags += ["--no-diff-attention"]
    if layout.num_kv_heads != layout.num_heads:
        flags.append("--group-query-attention")
    if layout.tied:
        flags.append("--tie-embeddings-and-output-weights")
    return flags
