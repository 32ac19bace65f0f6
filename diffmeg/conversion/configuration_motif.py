"""Motif's config.json as a transformers config (diffmeg's own, shipped with every Motif export).

Motif Technologies' checkpoints (`model_type` "motif") name their config and model classes in `auto_map`;
diffmeg's export ships these two files of its own under the same names (configuration_motif.MotifConfig,
modeling_motif.MotifForCausalLM), so the folder loads with `trust_remote_code=True` and its `auto_map` is a
Motif folder's. It imports nothing from diffmeg: the folder works without diffmeg installed.

Every key of config.json is kept as it is (`sliding_window` beside `use_sliding_window: false` included); the
model refuses what it cannot run (a sliding window, `k_ratio` other than 1, biases). Two attributes are
derived for transformers' LLaMA machinery, which the model reuses: `rope_parameters` (plain RoPE of
`rope_theta`) and `layer_types` (full attention in every layer unless the window is on: transformers' cache
would otherwise read a `sliding_window` value as a window).
"""

from __future__ import annotations

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4 spells it PretrainedConfig
    from transformers import PretrainedConfig as PreTrainedConfig


class MotifConfig(PreTrainedConfig):
    """DIFF V1 with PolyNorm (Motif-2.6B), or with grouped differential attention (Motif-2-12.7B:
    `num_noise_heads`). Head counts as Motif counts them: sub-heads (2.6B), query and K heads (12.7B)."""

    model_type = "motif"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        intermediate_size: int = 8192,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        num_noise_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "poly_norm",
        max_position_embeddings: int = 8192,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        attn_rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        k_ratio: int = 1,
        use_bias: bool = False,
        use_sliding_window: bool = False,
        sliding_window: int | None = None,
        layer_types: list[str] | None = None,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        attention_dropout: float = 0.0,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.num_noise_heads = num_noise_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.attn_rms_norm_eps = attn_rms_norm_eps
        self.rope_theta = rope_theta
        self.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
        self.k_ratio = k_ratio
        self.use_bias = use_bias
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        kind = "sliding_attention" if use_sliding_window else "full_attention"
        self.layer_types = layer_types if layer_types is not None else [kind] * num_hidden_layers
        self.use_cache = use_cache
        self.attention_dropout = attention_dropout
        self.attention_bias = use_bias  # what transformers' LLaMA pieces read
        self.mlp_bias = use_bias
        self.pretraining_tp = 1
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        # after the base class (transformers 4 sets them there; 5 no longer has them)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
