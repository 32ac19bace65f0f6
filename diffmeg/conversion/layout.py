"""The sizes a megatron-core model and its Hugging Face counterpart must share.

Two architectures, one base (`ModelLayout`: layers, widths, vocabulary, RoPE, epsilon, head counts, tied
or untied output layer):

- `DiffLayout`: a DIFF model <-> transformers' DiffLlama. h differential heads, g differential KV heads,
  head dim d. megatron-core sees 2h sub-heads and 2g query sub-groups of width d; DiffLlama sees
  `num_attention_heads = 2h` and `num_key_value_heads = 2g` heads of width d.
- `LlamaLayout`: the Transformer baseline (`--no-diff-attention`) <-> transformers' Llama. n heads, g KV
  heads (query groups), head dim d, the same counts in both formats.
- `Diff2Layout`: a DIFF V2 model <-> diffmeg's own LLaMA-layout class (`modeling_diff2.py`, loaded with
  `trust_remote_code=True`) over transformers' own LlamaConfig. h output heads (2h query heads of d), g KV
  heads, plus `lambda_proj`; grouped differential attention (GDA, `--num-noise-heads n`): h + n query heads,
  group by group `[signal x r, noise]` (r = h / n).
- `MotifLayout`: a DIFF V1 model with PolyNorm and Motif's lambda_init <-> Motif Technologies'
  `MotifForCausalLM` (both directions; the export ships diffmeg's own remote code), DIFF's counts plus n
  noise heads for the 12.7B layout.

Expected tensor shapes are derived here once, so both directions refuse a mismatching input before
converting anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diffmeg.errors import DiffmegError

GLOBALS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
"""megatron-core -> Hugging Face names of the tensors outside the layers (the same in every architecture;
a tied layout has no output layer: `ModelLayout.mcore_global_shapes` names what it holds)."""


@dataclass(frozen=True)
class ModelLayout:
    """What both architectures share (counts as `pretrain_diff.py` takes them for the architecture)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    """Attention heads as `--num-attention-heads` counts them (DIFF: differential heads)."""
    num_kv_heads: int
    """KV heads as `--num-query-groups` counts them; divides num_heads."""
    head_dim: int
    """d: `--kv-channels`, the width of one (sub-)head's query and key."""
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    norm_eps: float
    """Epsilon of every RMSNorm (Hugging Face models have one epsilon)."""
    tied: bool = False
    """The output layer is the word embedding (`--tie-embeddings-and-output-weights`, Hugging Face's
    `tie_word_embeddings`): neither format stores an output-layer tensor (`output_layer` / `lm_head`)."""

    architecture = ""
    """transformers' class name (`config.json` "architectures")."""
    model_type = ""
    """transformers' `model_type`."""
    hf_name = ""
    """How messages name the Hugging Face model ("DiffLlama", "Llama")."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise DiffmegError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise DiffmegError(
                f"{self.num_kv_heads} {self._kv_name} do not divide the {self.num_heads} {self._head_name}"
            )

    _head_name = "heads"
    _kv_name = "KV heads"

    @property
    def queries_per_group(self) -> int:
        """r: query heads (DIFF: query sub-heads) in each megatron-core query group (sub-group)."""
        return self.num_heads // self.num_kv_heads

    @property
    def attention_width(self) -> int:
        """Columns of `linear_proj` / `o_proj`: the concatenated head outputs (h heads of d)."""
        return self.num_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        """Rows of megatron-core's fused QKV weight: g groups of (r query + 1 key + 1 value) rows of d."""
        return self.num_kv_heads * (self.queries_per_group + 2) * self.head_dim

    def mcore_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of one layer's tensors in the TP=1 megatron-core state dict (keys inside the layer)."""
        hidden = self.hidden_size
        return {
            "input_layernorm.weight": (hidden,),
            "self_attention.linear_qkv.weight": (self.qkv_rows, hidden),
            "self_attention.linear_proj.weight": (hidden, self.attention_width),
            "pre_mlp_layernorm.weight": (hidden,),
            "mlp.linear_fc1.weight": (2 * self.ffn_hidden_size, hidden),
            "mlp.linear_fc2.weight": (hidden, self.ffn_hidden_size),
        }

    def mcore_global_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensors outside the layers (embedding, final norm, the output layer unless tied)."""
        shapes = {
            "embedding.word_embeddings.weight": (self.vocab_size, self.hidden_size),
            "decoder.final_layernorm.weight": (self.hidden_size,),
            "output_layer.weight": (self.vocab_size, self.hidden_size),
        }
        if self.tied:
            del shapes["output_layer.weight"]
        return shapes

    def hf_attention_heads(self) -> tuple[int, int]:
        """(num_attention_heads, num_key_value_heads) as the Hugging Face config counts them."""
        return self.num_heads, self.num_kv_heads

    def hf_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of one Hugging Face decoder layer's tensors (keys inside `model.layers.N.`)."""
        hidden, d, ffn = self.hidden_size, self.head_dim, self.ffn_hidden_size
        heads, kv_heads = self.hf_attention_heads()
        return {
            "input_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (heads * d, hidden),
            "self_attn.k_proj.weight": (kv_heads * d, hidden),
            "self_attn.v_proj.weight": (kv_heads * d, hidden),
            "self_attn.o_proj.weight": (hidden, self.attention_width),
            "post_attention_layernorm.weight": (hidden,),
            "mlp.gate_proj.weight": (ffn, hidden),
            "mlp.up_proj.weight": (ffn, hidden),
            "mlp.down_proj.weight": (hidden, ffn),
        }

    def mcore_parameters(self) -> int:
        """Elements of the megatron-core model (what an import writes)."""
        per_layer = sum(math.prod(s) for s in self.mcore_layer_shapes().values())
        return sum(math.prod(s) for s in self.mcore_global_shapes().values()) + self.num_layers * per_layer

    def hf_global_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the Hugging Face tensors outside the layers (no `lm_head` when tied)."""
        return {GLOBALS[name]: shape for name, shape in self.mcore_global_shapes().items()}


@dataclass(frozen=True)
class DiffLayout(ModelLayout):
    """Sizes of one DIFF model (counts in differential heads, as `pretrain_diff.py` takes them).

    num_heads = h differential heads (each a Q1/Q2 pair of width d and a V of width 2d); num_kv_heads
    = g differential KV heads (each a K1/K2 pair and a V of width 2d); head_dim = d (V and the head
    output are 2d wide); norm_eps also serves the per-head norm (DiffLlama has one epsilon).
    """

    architecture = "DiffLlamaForCausalLM"
    model_type = "diffllama"
    hf_name = "DiffLlama"
    _head_name = "heads"
    _kv_name = "differential KV heads"

    @property
    def attention_width(self) -> int:
        return self.num_heads * 2 * self.head_dim

    @property
    def qkv_rows(self) -> int:
        """2g sub-groups of (r query + 1 key + 1 value) rows of d."""
        return 2 * self.num_kv_heads * (self.queries_per_group + 2) * self.head_dim

    def mcore_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        d = self.head_dim
        shapes = super().mcore_layer_shapes()
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            shapes[f"self_attention.core_attention.{name}"] = (d,)
        shapes["self_attention.core_attention.head_norm.weight"] = (2 * d,)
        return shapes

    def hf_attention_heads(self) -> tuple[int, int]:
        return 2 * self.num_heads, 2 * self.num_kv_heads  # DiffLlama counts the sub-heads

    def hf_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().hf_layer_shapes()
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            shapes[f"self_attn.{name}"] = (self.head_dim,)
        return shapes


@dataclass(frozen=True)
class LlamaLayout(ModelLayout):
    """Sizes of one Transformer baseline (`--no-diff-attention`): n heads over g query groups of width d."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    hf_name = "Llama"


@dataclass(frozen=True)
class Diff2Layout(ModelLayout):
    """Sizes of one DIFF V2 model: h output heads over g KV heads, lambda_proj h x H, and h + n query heads of
    d (n noise heads; the 1:1 DIFF V2 has n = h, grouped differential attention n < h).

    megatron-core's fused QKV holds, per KV group, its (h + n)/g query heads, one key and one value (Llama's
    layout with h + n query heads, laid out group by group `[signal x r, noise]`, r = h / n); config.json
    counts `num_attention_heads = h` (and `num_noise_heads = n` when grouped); `linear_proj` takes the h
    combined heads (Llama's width).
    """

    num_noise_heads: int | None = None
    """n: noise heads of grouped differential attention (`--num-noise-heads`, config.json's
    `num_noise_heads`); None for the 1:1 DIFF V2 (n = h: each head's own pair), which its export and
    `pretrain_flags` leave out, so a 1:1 export stays what it was."""

    architecture = "Diff2ForCausalLM"
    model_type = "llama"
    """Its config is Llama's, field for field; only the model class (`architecture`) is diffmeg's. So
    transformers reads config.json, and the tokenizer beside it, without remote code."""
    hf_name = "DIFF V2"
    _head_name = "DIFF V2 heads"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_noise_heads(
            self, self._head_name, "KV heads (a group of signal heads and its noise head share one KV head)"
        )

    @property
    def noise_heads(self) -> int:
        """n: noise heads (h for the 1:1 DIFF V2)."""
        return self.num_heads if self.num_noise_heads is None else self.num_noise_heads

    @property
    def query_heads(self) -> int:
        """h + n query heads of d (2h for the 1:1 DIFF V2)."""
        return self.num_heads + self.noise_heads

    @property
    def queries_per_group(self) -> int:
        """The (h + n)/g query heads of each KV group."""
        return self.query_heads // self.num_kv_heads

    def mcore_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().mcore_layer_shapes()
        shapes["self_attention.linear_lambda.weight"] = (self.num_heads, self.hidden_size)
        return shapes

    def hf_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().hf_layer_shapes()
        shapes["self_attn.q_proj.weight"] = (self.query_heads * self.head_dim, self.hidden_size)
        shapes["self_attn.lambda_proj.weight"] = (self.num_heads, self.hidden_size)
        return shapes


def _check_noise_heads(layout, heads_name: str, kv_name: str) -> None:
    """A grouped layout's `num_noise_heads`: n = h is the 1:1 model however it was named (one layout, one
    export: stored as None); otherwise n divides the h heads and is a multiple of the g KV heads."""
    n, h, g = layout.num_noise_heads, layout.num_heads, layout.num_kv_heads
    if n == h:
        object.__setattr__(layout, "num_noise_heads", None)
    elif n is not None and (n < 1 or h % n or n % g):
        raise DiffmegError(
            f"num_noise_heads {n} must divide the {h} {heads_name} and be a multiple of the {g} {kv_name}"
        )


@dataclass(frozen=True)
class MotifLayout(DiffLayout):
    """Sizes of one Motif model (Motif Technologies' `MotifForCausalLM`, `model_type` "motif"): DIFF V1 with
    Motif's PolyNorm MLP, its lambda_init schedule and, in the 12.7B layout, grouped differential attention.

    Counts as `pretrain_diff.py` takes them: h signal (differential) heads, g differential KV heads (each a
    K1/K2 pair and a V of 2d), head dim d, n noise heads (None: the 2.6B layout, each head its own pair).
    Motif's config.json counts sub-heads: 2.6B `num_attention_heads = 2h`, `num_key_value_heads = 2g`;
    12.7B `num_attention_heads = h + n` query heads laid out group by group `[signal x r, noise]`,
    `num_key_value_heads = 2n` (g = n). Both orders are megatron-core's query sub-heads as they are.
    """

    num_noise_heads: int | None = None
    """n: noise heads of the 12.7B layout (config.json's `num_noise_heads`); None for the 2.6B layout."""

    architecture = "MotifForCausalLM"
    model_type = "motif"
    hf_name = "Motif"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_noise_heads(self, "signal heads", "differential KV heads")

    @property
    def query_heads(self) -> int:
        """h + n query sub-heads of d (2h for the 2.6B layout)."""
        return self.num_heads + (self.num_heads if self.num_noise_heads is None else self.num_noise_heads)

    @property
    def qkv_rows(self) -> int:
        """The h + n query sub-heads and the 2g key and 2g value sub-heads, d rows each."""
        return (self.query_heads + 4 * self.num_kv_heads) * self.head_dim

    def mcore_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().mcore_layer_shapes()
        shapes["mlp.poly_norm.weight"], shapes["mlp.poly_norm.bias"] = (3,), (1,)
        return shapes

    def hf_attention_heads(self) -> tuple[int, int]:
        return self.query_heads, 2 * self.num_kv_heads

    def hf_layer_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().hf_layer_shapes()
        shapes["self_attn.subln.weight"] = (2 * self.head_dim,)
        shapes["mlp.act_fn.weight"], shapes["mlp.act_fn.bias"] = (3,), (1,)
        return shapes
