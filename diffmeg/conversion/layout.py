"""The sizes a megatron-core DIFF model and a DiffLlama model must share, in DIFF terms.

Both formats are described by one `DiffLayout`: h differential heads, g differential KV heads, head
dim d. megatron-core sees 2h sub-heads and 2g query sub-groups of width d; DiffLlama sees
`num_attention_heads = 2h` and `num_key_value_heads = 2g` heads of width d. Expected tensor shapes
are derived here once, so both directions refuse a mismatching input before converting anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffmeg.errors import DiffmegError


@dataclass(frozen=True)
class DiffLayout:
    """Sizes of one DIFF model (counts in differential heads, as `pretrain_diff.py` takes them)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    """h: differential heads (each a Q1/Q2 pair of width d and a V of width 2d)."""
    num_kv_heads: int
    """g: differential KV heads (each a K1/K2 pair and a V of width 2d); g divides h."""
    head_dim: int
    """d: width of one sub-head (Q1, Q2, K1, K2); V and the head output are 2d wide."""
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    norm_eps: float
    """Epsilon of every RMSNorm, the per-head norm included (DiffLlama has one epsilon)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise DiffmegError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise DiffmegError(
                f"{self.num_kv_heads} differential KV heads do not divide the {self.num_heads} heads"
            )

    @property
    def queries_per_group(self) -> int:
        """r = 2h / 2g: query sub-heads in each megatron-core query sub-group."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV weight: 2g sub-groups of (r query + 1 key + 1 value) rows of d."""
        return 2 * self.num_kv_heads * (self.queries_per_group + 2) * self.head_dim

    def mcore_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of one layer's tensors in the TP=1 megatron-core state dict (keys inside the layer)."""
        hidden, d, h = self.hidden_size, self.head_dim, self.num_heads
        return {
            "input_layernorm.weight": (hidden,),
            "self_attention.linear_qkv.weight": (self.qkv_rows, hidden),
            "self_attention.linear_proj.weight": (hidden, h * 2 * d),
            "self_attention.core_attention.lambda_q1": (d,),
            "self_attention.core_attention.lambda_k1": (d,),
            "self_attention.core_attention.lambda_q2": (d,),
            "self_attention.core_attention.lambda_k2": (d,),
            "self_attention.core_attention.head_norm.weight": (2 * d,),
            "pre_mlp_layernorm.weight": (hidden,),
            "mlp.linear_fc1.weight": (2 * self.ffn_hidden_size, hidden),
            "mlp.linear_fc2.weight": (hidden, self.ffn_hidden_size),
        }

    def mcore_global_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensors outside the layers (embedding, final norm, untied output layer)."""
        return {
            "embedding.word_embeddings.weight": (self.vocab_size, self.hidden_size),
            "decoder.final_layernorm.weight": (self.hidden_size,),
            "output_layer.weight": (self.vocab_size, self.hidden_size),
        }

    def hf_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of one DiffLlama decoder layer's tensors (keys inside `model.layers.N.`)."""
        hidden, d, h, g = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        ffn = self.ffn_hidden_size
        return {
            "input_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (2 * h * d, hidden),
            "self_attn.k_proj.weight": (2 * g * d, hidden),
            "self_attn.v_proj.weight": (2 * g * d, hidden),
            "self_attn.o_proj.weight": (hidden, 2 * h * d),
            "self_attn.lambda_q1": (d,),
            "self_attn.lambda_k1": (d,),
            "self_attn.lambda_q2": (d,),
            "self_attn.lambda_k2": (d,),
            "post_attention_layernorm.weight": (hidden,),
            "mlp.gate_proj.weight": (ffn, hidden),
            "mlp.up_proj.weight": (ffn, hidden),
            "mlp.down_proj.weight": (hidden, ffn),
        }

    def hf_global_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "model.embed_tokens.weight": (self.vocab_size, self.hidden_size),
            "model.norm.weight": (self.hidden_size,),
            "lm_head.weight": (self.vocab_size, self.hidden_size),
        }
