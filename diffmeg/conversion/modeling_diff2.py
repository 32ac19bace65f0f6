"""DIFF V2 for Hugging Face transformers: LLaMA plus differential heads (loaded as remote code).

transformers has no DIFF V2 class, so diffmeg's export writes this file beside the weights and names it
in config.json's `auto_map`; `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` then
builds it. It imports nothing from diffmeg: the exported folder works without diffmeg installed.

The config is transformers' own `LlamaConfig` (config.json's `model_type` is "llama", `architectures`
names `Diff2ForCausalLM`): a config transformers knows loads without remote code, so `AutoConfig` and
`AutoTokenizer` (which reads the model's config first) read the folder as they read any Llama's, without a
`trust_remote_code` prompt. The one field DIFF V2 may add, `num_noise_heads` (grouped differential
attention), is an extra attribute LlamaConfig keeps as it is.

The model is LlamaForCausalLM except the attention (unilm Diff-Transformer-V2's definition, and Motif's
grouped differential attention, GDA):
- h signal heads share n noise heads (`num_noise_heads`; absent: n = h, DIFF V2's pairs), r = h / n each;
- `q_proj` gives h + n query heads of `head_dim` (query head j at rows j*d..(j+1)*d) laid out group by
  group `[signal x r, noise]`; `k_proj`/`v_proj` give g KV heads; query head j attends with KV head
  j // ((h + n)/g), so a group's r + 1 heads share K and V (n is a multiple of g);
- signal head i = m r + k (head k of group m) outputs `attn[signal i] - sigmoid(lambda_proj(x))_i *
  attn[noise of group m]` (`lambda_proj`: hidden -> h, no bias), computed in fp32; for n = h that is
  `attn[2i] - lambda_i attn[2i+1]`; `o_proj` maps the h heads back to the hidden size.
`num_attention_heads` is h (output heads), `num_key_value_heads` g, `head_dim` d. RoPE, norms,
SwiGLU and the KV cache are LLaMA's (non-interleaved RoPE), so `generate` works as for LLaMA.

Why the attention runs transformers' own `LlamaAttention.forward`: that method owns the KV cache (its
argument name and `update` signature have changed between releases: `past_key_value`, then
`past_key_values`, then `cache`). A copy of it here once missed such a rename and silently decoded every
new token against itself. So this class changes only what DIFF V2 changes: the query projection's width,
the query heads per KV head, and the output projection, which combines each group's heads before its matmul.
A cache handed over under another name than the one the installed `LlamaAttention.forward` takes is
passed on under that one; a transformers whose attention takes no recognisable cache refuses to load.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


def _cache_argument() -> str:
    """The name under which this transformers' `LlamaAttention.forward` takes the KV cache."""
    params = inspect.signature(LlamaAttention.forward).parameters
    for name, param in params.items():
        if name in ("cache", "past_key_values", "past_key_value") or "Cache" in str(param.annotation):
            return name
    raise ImportError(
        "this transformers' LlamaAttention.forward takes no KV cache argument that DIFF V2's modeling file "
        "recognises; install a transformers version diffmeg supports (the range in its pyproject.toml)"
    )


_CACHE_ARGUMENT = _cache_argument()


def noise_heads(config: LlamaConfig) -> int:
    """n: the config's `num_noise_heads` (grouped differential attention), else one per head (DIFF V2)."""
    heads = config.num_attention_heads
    noise = getattr(config, "num_noise_heads", heads)
    noise = heads if noise is None else int(noise)
    if noise < 1 or heads % noise or noise % config.num_key_value_heads:
        raise ValueError(
            f"num_noise_heads {noise} must divide num_attention_heads {heads} and be a multiple of "
            f"num_key_value_heads {config.num_key_value_heads}"
        )
    return noise


class Diff2OutputProjection(nn.Linear):
    """`o_proj`: combines the h + n attention heads group by group with this call's lambda, then projects
    h x d.

    An `nn.Linear` of h*d inputs (so the weight keeps LLaMA's name and shape); its input is LLaMA's
    attention output of h + n heads, [b, s, (h + n)*d], n groups of r = h / n signal heads and their noise
    head. `Diff2Attention.forward` sets `lam` for the duration of one call.
    """

    def __init__(self, heads: int, noise: int, head_dim: int, hidden: int, bias: bool) -> None:
        super().__init__(heads * head_dim, hidden, bias=bias)
        self.heads, self.noise, self.head_dim = heads, noise, head_dim
        self.lam: torch.Tensor | None = None  # [b, s, h], fp32 or wider

    def forward(self, attn: torch.Tensor) -> torch.Tensor:
        if self.lam is None:
            raise RuntimeError("Diff2OutputProjection is called by Diff2Attention.forward, which sets lambda")
        n, r = self.noise, self.heads // self.noise
        groups = attn.view(*attn.shape[:-1], n, r + 1, self.head_dim)  # [b, s, n, r + 1, d]
        groups = groups.to(self.lam.dtype)
        lam = self.lam.view(*self.lam.shape[:-1], n, r, 1)  # [b, s, h] -> [b, s, n, r, 1]
        out = (groups[..., :r, :] - lam * groups[..., r:, :]).to(attn.dtype)  # [b, s, n, r, d]
        return super().forward(out.reshape(*attn.shape[:-1], -1))  # [b, s, h*d] -> [b, s, hidden]


class Diff2Attention(LlamaAttention):
    """LLaMA attention over h + n query heads, each group's signal heads minus a per-token sigmoid lambda
    times its noise head."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        heads, noise, d = config.num_attention_heads, noise_heads(config), self.head_dim
        self.num_key_value_groups = (heads + noise) // config.num_key_value_heads  # query heads per KV head
        self.q_proj = nn.Linear(config.hidden_size, (heads + noise) * d, bias=config.attention_bias)
        self.o_proj = Diff2OutputProjection(heads, noise, d, config.hidden_size, bias=config.attention_bias)
        self.lambda_proj = nn.Linear(config.hidden_size, heads, bias=False)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        caches = {name: value for name, value in kwargs.items() if isinstance(value, Cache)}
        if len({id(value) for value in caches.values()}) > 1:
            raise TypeError(f"Diff2Attention got several KV caches ({', '.join(caches)}); pass one")
        for name, value in caches.items():  # whichever name the caller used: the one LLaMA's forward takes
            kwargs.pop(name)
            kwargs[_CACHE_ARGUMENT] = value
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        lam = torch.sigmoid(self.lambda_proj(hidden_states).to(dtype))  # [b, s, h]
        self.o_proj.lam = lam
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self.o_proj.lam = None


class Diff2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.self_attn = Diff2Attention(config, layer_idx)


class Diff2Model(LlamaModel):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(Diff2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.post_init()


class Diff2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.model = Diff2Model(config)
        self.post_init()
