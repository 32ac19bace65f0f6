"""Motif's architecture for Hugging Face transformers (diffmeg's own, shipped with every Motif export).

Written from the format's description (docs/conversion.md, "Motif"), not from Motif's code: a LLaMA-layout
decoder (pre-RMSNorm, rotate-half RoPE, no biases) with two changes, loaded with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`. It imports nothing from diffmeg.

- Differential attention, DIFF V1. h differential heads of 2 x d; head i takes the causal softmax maps A1
  (its signal query against K1 of its key pair j) and A2 (its noise query against K2 of pair j) and outputs
  `(A1 - lambda A2) V_j`, V_j of 2d, then `subln` (RMSNorm over 2d with a weight, `attn_rms_norm_eps`) and
  a factor `1 - lambda_init`; `o_proj` maps the h x 2d outputs back. lambda = exp(lambda_q1 . lambda_k1) -
  exp(lambda_q2 . lambda_k2) + lambda_init, lambda_init = 0.8 - 0.6 exp(-0.3 (layer_idx - 1)), layer_idx
  from 0 (Motif's schedule). Maps, lambda and subln in fp32 or wider.
  * Motif-2.6B (no `num_noise_heads`): `num_attention_heads` 2h query sub-heads, 2i / 2i+1 the signal /
    noise query of head i; `num_key_value_heads` 2g key sub-heads, 2j / 2j+1 = K1 / K2 of pair j; head i
    uses pair i // (h / g).
  * Motif-2-12.7B (`num_noise_heads` n): `num_attention_heads` (r + 1) n query heads, group m = `[signal x
    r, noise]`; `num_key_value_heads` 2n, K1 / K2 of group m at 2m / 2m+1. Signal head t of group m is
    differential head m r + t; the r heads of a group share their noise map.
  v_proj holds 2g sub-heads of d: V_j is sub-heads 2j and 2j+1 side by side. The KV cache holds k and v as
  those sub-heads (a plain LLaMA-shaped cache).
- MLP: `down_proj(PolyNorm(gate_proj(x)) * up_proj(x))`, PolyNorm(z) = w0 norm(z^3) + w1 norm(z^2) + w2
  norm(z) + b, norm(u) = u / sqrt(mean(u^2) + 1e-6) over the FFN dimension (`mlp.act_fn.weight` [3],
  `mlp.act_fn.bias` [1]).

Everything around the layers (embedding, causal mask, KV-cache creation, `generate`) is transformers' own
LLaMA code, so it follows transformers' releases; the norms and RoPE tables are computed here in fp32 or
wider (a float64 model is float64 throughout: LLaMA's norms and tables are fp32). The attention is
computed here (eager; the cache is taken under whatever name the installed transformers passes it and
updated with `cache.update(k, v, layer_idx)`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import (
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    apply_rotary_pos_emb,
)

from .configuration_motif import MotifConfig

POLY_NORM_EPS = 1e-6


def motif_lambda_init(layer_idx: int) -> float:
    """Motif's lambda_init of the layer at 0-based `layer_idx`."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer_idx - 1))


def _check_config(config: MotifConfig) -> None:
    """What this model cannot run, refused in one line naming the key."""
    if config.use_sliding_window:
        raise ValueError("use_sliding_window: true is not supported by this Motif model (full causal only)")
    if int(config.k_ratio) != 1:
        raise ValueError(f"k_ratio {config.k_ratio} is not supported; only a K1/K2 pair per group (1)")
    if config.use_bias or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("biases are not supported by this Motif model")
    if config.hidden_act != "poly_norm":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; Motif's MLP is poly_norm")


class MotifRMSNorm(nn.Module):
    """RMSNorm with a weight, in fp32 or wider (LLaMA's computes in fp32 even for a float64 model)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        out = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(wide.dtype)
        return out.to(x.dtype)


class MotifRotaryEmbedding(nn.Module):
    """Rotate-half RoPE tables (cos, sin) [b, s, d] for `position_ids`, computed in fp32 or wider and
    returned in the input's dtype. No buffer: from_pretrained builds modules on the meta device and never
    fills a non-persistent one."""

    def __init__(self, config: MotifConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = config.head_dim, float(config.rope_theta)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        wide = torch.promote_types(x.dtype, torch.float32)
        exponents = torch.arange(0, self.head_dim, 2, dtype=wide, device=x.device) / self.head_dim
        inv_freq = 1.0 / self.theta**exponents  # [d/2]
        angles = position_ids.to(wide)[..., None] * inv_freq  # [b, s, d/2]
        angles = torch.cat([angles, angles], dim=-1)  # [b, s, d]: both halves of the rotation
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


class MotifPolyNorm(nn.Module):
    """PolyNorm over the last dimension, in fp32 or wider."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), 1.0 / 3.0))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        wide = z.to(torch.promote_types(z.dtype, torch.float32))

        def norm(u: torch.Tensor) -> torch.Tensor:
            return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + POLY_NORM_EPS)

        w, b = self.weight.to(wide.dtype), self.bias.to(wide.dtype)
        out = w[0] * norm(wide**3) + w[1] * norm(wide**2) + w[2] * norm(wide) + b
        return out.to(z.dtype)


class MotifMLP(nn.Module):
    def __init__(self, config: MotifConfig) -> None:
        super().__init__()
        hidden, ffn = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act_fn = MotifPolyNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def head_plan(config: MotifConfig) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per differential head: its signal query head and noise slot; per noise slot: its query head and key
    pair. (2.6B: one noise slot per head; 12.7B: one per group, shared by its r signal heads.)"""
    queries, keys, noise = config.num_attention_heads, config.num_key_value_heads, config.num_noise_heads
    if noise is None:
        if queries % 2 or keys % 2 or (queries // 2) % (keys // 2):
            raise ValueError(
                f"num_attention_heads {queries} / num_key_value_heads {keys} must be sub-head pairs, the "
                f"pairs of queries a multiple of the pairs of keys"
            )
        heads, per_pair = queries // 2, (queries // 2) // (keys // 2)
        signal, slot = [2 * i for i in range(heads)], list(range(heads))
        return signal, slot, [2 * i + 1 for i in range(heads)], [i // per_pair for i in range(heads)]
    noise = int(noise)
    if keys != 2 * noise or queries % noise or queries <= noise:
        raise ValueError(
            f"num_attention_heads {queries} must be (r + 1) x num_noise_heads {noise} and "
            f"num_key_value_heads {keys} must be 2 x num_noise_heads"
        )
    r = queries // noise - 1
    signal = [m * (r + 1) + t for m in range(noise) for t in range(r)]
    slot = [m for m in range(noise) for _ in range(r)]
    return signal, slot, [m * (r + 1) + r for m in range(noise)], list(range(noise))


def _find_cache(kwargs: dict) -> Cache | None:
    """The KV cache, whichever name (`cache`, `past_key_values`, `past_key_value`) it came under."""
    caches = {id(v): v for v in kwargs.values() if isinstance(v, Cache)}
    if len(caches) > 1:
        raise TypeError("MotifAttention got several KV caches; pass one")
    return next(iter(caches.values()), None)


class MotifAttention(nn.Module):
    """Motif's differential attention (both layouts), eager, maps in fp32 or wider."""

    def __init__(self, config: MotifConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d, hidden = config.head_dim, config.hidden_size
        self.head_dim = d
        # Plain lists, not buffers: from_pretrained builds modules on the meta device and never fills a
        # non-persistent buffer (it would hold garbage indices).
        self.signal_query, self.noise_slot, self.noise_query, self.noise_pair = head_plan(config)
        self.signal_pair = [self.noise_pair[m] for m in self.noise_slot]
        self.num_heads = len(self.signal_query)
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * 2 * d, hidden, bias=False)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(d, dtype=torch.float32).normal_(0.0, 0.1)))
        self.subln = MotifRMSNorm(2 * d, eps=config.attn_rms_norm_eps)
        self.lambda_init = motif_lambda_init(layer_idx)

    def _maps(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt d): q [b, n, s, d], k [b, n, t, d] -> [b, n, s, t] (fp32 or wider)."""
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        s, t = scores.shape[-2:]
        if mask is None:  # causal, the s queries being the last of the t positions
            allowed = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
            scores = scores.masked_fill(~allowed, float("-inf"))
        elif mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[..., :t], float("-inf"))
        else:
            scores = scores + mask[..., :t].to(scores.dtype)
        return scores.softmax(-1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        b, s, _ = hidden_states.shape
        d = self.head_dim
        q = self.q_proj(hidden_states).view(b, s, -1, d).transpose(1, 2)  # [b, s, Q*d] -> [b, Q, s, d]
        k = self.k_proj(hidden_states).view(b, s, -1, d).transpose(1, 2)  # [b, 2g, s, d]
        v = self.v_proj(hidden_states).view(b, s, -1, d).transpose(1, 2)  # [b, 2g, s, d]: V halves
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        cache = _find_cache(kwargs)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # [b, 2g, t, d] each
        wide = torch.promote_types(hidden_states.dtype, torch.float32)
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
        t = k.shape[2]
        pairs = v.view(b, -1, 2, t, d).transpose(2, 3).reshape(b, -1, t, 2 * d)  # [b, g, t, 2d]: V_j
        signal_pair = torch.tensor(self.signal_pair, device=q.device)
        noise_pair = torch.tensor(self.noise_pair, device=q.device)
        a1 = self._maps(q[:, self.signal_query], k[:, 2 * signal_pair], attention_mask)  # [b, h, s, t]
        a2 = self._maps(q[:, self.noise_query], k[:, 2 * noise_pair + 1], attention_mask)  # one per slot
        a2 = a2[:, self.noise_slot]  # [b, h, s, t]: each head's noise map
        lam = (
            torch.exp(torch.dot(self.lambda_q1.to(wide), self.lambda_k1.to(wide)))
            - torch.exp(torch.dot(self.lambda_q2.to(wide), self.lambda_k2.to(wide)))
            + self.lambda_init
        )
        out = (a1 - lam * a2) @ pairs[:, signal_pair]  # [b, h, s, 2d]
        out = self.subln(out) * (1.0 - self.lambda_init)
        out = out.transpose(1, 2).reshape(b, s, -1).to(hidden_states.dtype)  # [b, h, s, 2d] -> [b, s, h*2d]
        return self.o_proj(out), None


class MotifDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MotifConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = MotifAttention(config, layer_idx)
        self.mlp = MotifMLP(config)
        self.input_layernorm = MotifRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MotifRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        attn, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class _MotifClasses:
    """What both Motif classes say to transformers (its config class, eager attention only)."""

    config_class = MotifConfig
    _no_split_modules = ["MotifDecoderLayer"]
    _supports_flash_attn = False
    _supports_sdpa = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False
    _can_record_outputs = {"hidden_states": MotifDecoderLayer, "attentions": MotifAttention}


class MotifModel(_MotifClasses, LlamaModel):
    """LlamaModel (its forward: embedding, RoPE tables, mask, cache creation) over Motif's layers."""

    def __init__(self, config: MotifConfig) -> None:
        _check_config(config)
        LlamaPreTrainedModel.__init__(self, config)  # not LlamaModel's: its layers would be LLaMA's MLPs
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(MotifDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = MotifRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MotifRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()


class MotifForCausalLM(_MotifClasses, LlamaForCausalLM):
    """LlamaForCausalLM (its forward and `generate`) over MotifModel."""

    def __init__(self, config: MotifConfig) -> None:
        LlamaPreTrainedModel.__init__(self, config)
        self.model = MotifModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
