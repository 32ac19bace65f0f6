"""DIFF V2 for Hugging Face transformers: LLaMA plus differential head pairs (loaded as remote code).

transformers has no DIFF V2 class, so diffmeg's export writes this file beside the weights and names it
in config.json's `auto_map`; `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` then
builds it. It imports nothing from diffmeg: the exported folder works without diffmeg installed.

The model is LlamaForCausalLM except the attention (unilm Diff-Transformer-V2's definition):
- `q_proj` gives 2h query heads of `head_dim` (query head j at rows j*d..(j+1)*d), `k_proj`/`v_proj`
  give g KV heads; query head j attends with KV head j // (2h/g), so heads 2i and 2i+1 share K and V;
- head i's output is `attn[2i] - sigmoid(lambda_proj(x))_i * attn[2i+1]` (`lambda_proj`: hidden -> h,
  no bias), computed in fp32; `o_proj` maps the h heads back to the hidden size.
`config.num_attention_heads` is h (output heads), `num_key_value_heads` g, `head_dim` d. RoPE, norms,
SwiGLU and the KV cache are LLaMA's (non-interleaved RoPE), so `generate` works as for LLaMA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)


class Diff2Config(LlamaConfig):
    """LlamaConfig for DIFF V2: `num_attention_heads` counts the h differential (output) heads."""

    model_type = "diffmeg_diff2"


class Diff2Attention(LlamaAttention):
    """LLaMA attention over 2h query heads, combined in pairs with a per-token sigmoid lambda."""

    def __init__(self, config: Diff2Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        heads, d = config.num_attention_heads, self.head_dim
        self.num_output_heads = heads
        self.num_key_value_groups = 2 * heads // config.num_key_value_heads  # query heads per KV head
        self.q_proj = nn.Linear(config.hidden_size, 2 * heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * d, config.hidden_size, bias=config.attention_bias)
        self.lambda_proj = nn.Linear(config.hidden_size, heads, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [b, 2h, s, d]
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [b, g, s, d]
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )  # attn: [b, s, 2h, d]
        dtype = torch.promote_types(attn.dtype, torch.float32)
        lam = torch.sigmoid(self.lambda_proj(hidden_states).to(dtype)).unsqueeze(-1)  # [b, s, h, 1]
        attn = attn.to(dtype)
        out = (attn[..., 0::2, :] - lam * attn[..., 1::2, :]).to(hidden_states.dtype)  # [b, s, h, d]
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class Diff2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Diff2Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.self_attn = Diff2Attention(config, layer_idx)


class Diff2Model(LlamaModel):
    config_class = Diff2Config

    def __init__(self, config: Diff2Config) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(Diff2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.post_init()


class Diff2ForCausalLM(LlamaForCausalLM):
    config_class = Diff2Config

    def __init__(self, config: Diff2Config) -> None:
        super().__init__(config)
        self.model = Diff2Model(config)
        self.post_init()
