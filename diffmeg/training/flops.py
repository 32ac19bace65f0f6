"""Model FLOPs per training step, counting the DIFF attention core correctly.

Per token and layer (forward, multiply-add = 2 FLOPs, causal attention counted as half the square):
  QKV projection        2 H (2h d + 2 * 2g d)       (2h sub-heads of d; 2g KV sub-heads)
  scores Q K^T          2 * (s/2) * 2h d            the same as a 2h-head Transformer
  context A V           2 * (s/2) * h * 2 * 2d      DIFF: two maps, each against V of width 2d
                        2 * (s/2) * 2h d            baseline
  output projection     2 * 2h d * H
  SwiGLU MLP            2 * 3 H F
plus the logits 2 H V once per token (tied or untied output weights alike). Training = 3 x forward
(backward is twice the forward); activation recompute is not counted (model FLOPs, as MFU is defined).
DIFF's core is 1.5x the baseline's. `causal=False` counts the full square instead (s in place of s/2):
Megatron-LM's published MFU convention, which a user comparing with its figures needs (higher by the
attention core's share).

DIFF V2 (h output heads, 2h query heads of d, g KV heads):
  QKV projection        2 H (2h d + 2 g d)          Q twice the baseline's
  lambda projection     2 H h
  scores and context    2 * (s/2) * 2h d each       an ordinary attention over 2h heads: 2x the baseline
  output projection     2 h d H                     the baseline's
(the pair combination, 3 h d per token, is negligible and not counted).

Grouped differential attention (n noise heads for the h signal heads; n = h above): h + n query heads of d
in the QKV projection, scores and (V2) context; V1's context is h + n maps against V of 2d (each noise
map once, not once per signal head); the output projections as above. So GDA 4:1 costs (h + n) / 2h = 5/8
of the 1:1 model's attention core.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffmeg.config import megatron_head_counts
from diffmeg.run_config import RunConfig


@dataclass(frozen=True)
class FlopsBreakdown:
    linear: float
    attention_core: float
    logits: float

    @property
    def total(self) -> float:
        return self.linear + self.attention_core + self.logits


def forward_flops_per_token(
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    kv_channels: int,
    seq_length: int,
    vocab_size: int,
    diff_attention: bool,
    diff_version: int = 1,
    num_noise_heads: int | None = None,
    causal: bool = True,
) -> FlopsBreakdown:
    """Forward FLOPs per token; head counts as on the command line (DIFF heads for DIFF models; noise heads
    None: as many as those). `causal`: the attention core counted as half the square (ours), else the full
    square (Megatron-LM's)."""
    d, H = kv_channels, hidden_size
    query_heads, kv_heads = megatron_head_counts(
        num_attention_heads, num_query_groups, diff_attention, diff_version, num_noise_heads
    )
    v2 = diff_attention and diff_version == 2
    qkv = 2 * H * (query_heads * d + 2 * kv_heads * d)
    proj = 2 * num_attention_heads * d * H * (2 if diff_attention and not v2 else 1)
    lam = 2 * H * num_attention_heads if v2 else 0
    mlp = 2 * 3 * H * ffn_hidden_size
    half = seq_length / 2 if causal else seq_length  # the keys a query attends to, on average
    scores = 2 * half * query_heads * d
    if diff_attention and not v2:
        context = 2 * half * query_heads * (2 * d)  # h signal and n noise maps against V of 2d
    else:
        context = 2 * half * query_heads * d
    return FlopsBreakdown(
        linear=num_layers * (qkv + proj + lam + mlp),
        attention_core=num_layers * (scores + context),
        logits=2 * H * vocab_size,
    )


def train_flops_per_iteration(run: RunConfig, causal: bool = True) -> float:
    """Model FLOPs of one optimizer step of the run (`causal` as in forward_flops_per_token)."""
    m = run.model
    per_token = forward_flops_per_token(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        seq_length=m.seq_length,
        vocab_size=m.vocab_size,
        diff_attention=m.diff_attention,
        diff_version=m.diff_version,
        num_noise_heads=m.num_noise_heads if m.diff_attention else None,
        causal=causal,
    )
    return 3.0 * per_token.total * run.training.global_batch_size * m.seq_length
