"""DIFF V2 for Hugging Face transformers: LLaMA plus differential head pairs (loaded as remote code).

transformers has no DIFF V2 class, so diffmeg's export writes this file beside the weights and names it
in config.json's `auto_map`; `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` then
builds it. It imports nothing from diffmeg: the exported folder works without diffmeg installed.

The config is transformers' own `LlamaConfig` (config.json's `model_type` is "llama", `architectures`
names `Diff2ForCausalLM`): DIFF V2 adds no config field, and a config transformers knows loads without
remote code, so `AutoConfig` and `AutoTokenizer` (which reads the model's config first) read the folder
as they read any Llama's, without a `trust_remote_code` prompt.

The model is LlamaForCausalLM except the attention (unilm Diff-Transformer-V2's definition):
- `q_proj` gives 2h query heads of `head_dim` (query head j at rows j*d..(j+1)*d), `k_proj`/`v_proj`
  give g KV heads; query head j attends with KV head j // (2h/g), so heads 2i and 2i+1 share K and V;
- head i's output is `attn[2i] - sigmoid(lambda_proj(x))_i * attn[2i+1]` (`lambda_proj`: hidden -> h,
  no bias), computed in fp32; `o_proj` maps the h heads back to the hidden size.
`num_attention_heads` is h (output heads), `num_key_value_heads` g, `head_dim` d. RoPE, norms,
SwiGLU and the KV cache are LLaMA's (non-interleaved RoPE), so `generate` works as for LLaMA.

Why the attention runs transformers' own `LlamaAttention.forward`: that method owns the KV cache (its
argument name and `update` signature have changed between releases: `past_key_value`, then
`past_key_values`, then `cache`). A copy of it here once missed such a rename and silently decoded every
new token against itself. So this class changes only what DIFF V2 changes: the query projection's width,
the query heads per KV head, and the output projection, which combines each head pair before its matmul.
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


class Diff2OutputProjection(nn.Linear):
    """`o_proj`: combines the 2h attention heads in pairs with this call's lambda, then projects h x d.

    An `nn.Linear` of h*d inputs (so the weight keeps LLaMA's name and shape); its input is LLaMA's
    attention output of 2h heads, [b, s, 2h*d]. `Diff2Attention.forward` sets `lam` for the duration of
    one call.
    """

    def __init__(self, heads: int, head_dim: int, hidden: int, bias: bool) -> None:
        super().__init__(heads * head_dim, hidden, bias=bias)
        self.heads, self.head_dim = heads, head_dim
        self.lam: torch.Tensor | None = None  # [b, s, h, 1], fp32 or wider

    def forward(self, attn: torch.Tensor) -> torch.Tensor:
        if self.lam is None:
            raise RuntimeError("Diff2OutputProjection is called by Diff2Attention.forward, which sets lambda")
        pairs = attn.view(*attn.shape[:-1], 2 * self.heads, self.head_dim)  # [b, s, 2h, d]
        pairs = pairs.to(self.lam.dtype)
        out = (pairs[..., 0::2, :] - self.lam * pairs[..., 1::2, :]).to(attn.dtype)  # [b, s, h, d]
        return super().forward(out.reshape(*attn.shape[:-1], -1))  # [b, s, hidden]


class Diff2Attention(LlamaAttention):
    """LLaMA attention over 2h query heads, combined in pairs with a per-token sigmoid lambda."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        heads, d = config.num_attention_heads, self.head_dim
        self.num_key_value_groups = 2 * heads // config.num_key_value_heads  # query heads per KV head
        self.q_proj = nn.Linear(config.hidden_size, 2 * heads * d, bias=config.attention_bias)
        self.o_proj = Diff2OutputProjection(heads, d, config.hidden_size, bias=config.attention_bias)
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
        self.o_proj.lam = lam.unsqueeze(-1)  # [b, s, h, 1]
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
