"""Cross-check `forward_flops_per_token` against deepspeed's FLOPs profiler on tiny models.

Conventions, and how each is reconciled:
  * MACs vs FLOPs. The profiler records multiply-accumulates (MACs) for matmul-like ops only (linear,
    matmul/bmm/baddbmm, SDPA); its "flops" total also counts element-wise work (softmax, norms, adds)
    that MFU conventions and our formula leave out. So we compare 2 x profiler MACs with our FLOPs.
  * Causal half. Our formula counts causal attention as half the score matrix (s/2 keys per query,
    what a flash kernel that skips masked tiles executes). The profiler sees full [sq, sk] products
    (SDPA with is_causal, megatron's masked baddbmm), so its attention-core count is 2x ours.
  * Model vs hardware FLOPs. The formula counts DIFF's core as the fused kernel and the two-call SDPA
    backend execute it: QK^T for both maps, A1 V and A2 V at width 2d -> 1.5x the baseline's 2h heads
    of d. Other implementations do different work for the same result, which the profiler shows:
    split-V (four calls of width d) recomputes each QK^T (4/3 of the model FLOPs); the explicit-map
    reference forms (A1 - lam A2) before a single PV product (2/3 of them).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip(
    "deepspeed.profiling.flops_profiler",
    reason="deepspeed not installed (DS_BUILD_OPS=0 pip install deepspeed)",
)

from deepspeed.profiling.flops_profiler import get_model_profile  # noqa: E402

from benchmarks.attention import core_flops  # noqa: E402
from diffmeg.kernels.reference import diff_attention_reference  # noqa: E402
from diffmeg.kernels.sdpa import diff_attention_sdpa  # noqa: E402
from diffmeg.training.flops import forward_flops_per_token  # noqa: E402
from tests.builders import tiny_config  # noqa: E402


class _Fn(torch.nn.Module):
    """Wrap a function so the profiler (which hooks modules) can run it."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def profiled_macs(fn, *args) -> int:
    _, macs, _ = get_model_profile(_Fn(fn), args=list(args), print_profile=False, as_string=False, warm_up=0)
    return int(macs)


@pytest.mark.parametrize("h,g", [(4, 4), (4, 2)])
def test_attention_core_flops_match_formula(h, g):
    b, s, d = 1, 64, 16
    gen = torch.Generator().manual_seed(0)
    q1, q2 = (torch.randn(b, h, s, d, generator=gen) for _ in range(2))
    k1, k2 = (torch.randn(b, g, s, d, generator=gen) for _ in range(2))
    v = torch.randn(b, g, s, 2 * d, generator=gen)
    lam = torch.tensor(0.5)
    scale = d**-0.5

    def baseline(q, k, vv):  # the Transformer's core: 2h heads of d (2g KV heads)
        return F.scaled_dot_product_attention(
            q, k, vv, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )

    base_q = torch.randn(b, 2 * h, s, d, generator=gen)
    base_kv = [torch.randn(b, 2 * g, s, d, generator=gen) for _ in range(2)]
    base = 2 * profiled_macs(baseline, base_q, *base_kv)
    two_call = 2 * profiled_macs(
        lambda *a: diff_attention_sdpa(*a, scale=scale, split_v=False), q1, q2, k1, k2, v, lam
    )
    split_v = 2 * profiled_macs(
        lambda *a: diff_attention_sdpa(*a, scale=scale, split_v=True), q1, q2, k1, k2, v, lam
    )
    reference = 2 * profiled_macs(
        lambda *a: diff_attention_reference(*a, scale=scale), q1, q2, k1, k2, v, lam
    )

    # Causal half: the profiler counts the full square, the formula half of it.
    assert base == 2 * core_flops(b, h, g, s, d, diff=False)
    assert two_call == 2 * core_flops(b, h, g, s, d, diff=True)
    assert two_call == 1.5 * base  # DIFF core = 1.5x baseline, as flops.py states
    assert 3 * split_v == 4 * two_call  # split-V redoes QK^T per half of V
    assert 3 * reference == 2 * two_call  # explicit map: one PV product for (A1 - lam A2)


@pytest.mark.parametrize(
    "diff,fields",
    [(True, {}), (False, {}), (True, {"noise": 1}), (True, {"noise": 1, "diff_version": 2})],
    ids=["diff", "transformer", "gda", "gda-v2"],
)
def test_whole_model_flops_match_formula(single_rank_parallel_state, diff, fields):
    """megatron-core GPTModel (tiny): linears + logits exactly, attention core with the causal factor 2;
    grouped differential attention (2 signal heads, 1 noise head) in both versions."""
    from diffmeg.model import build_model

    layers, heads, kv_heads, d, ffn, vocab, b, s = 2, 2, 1, 16, 96, 128, 2, 32
    sub = 2 if diff and not fields else 1  # megatron-core counts sub-heads; DIFF heads are pairs of them
    # the baseline has 2h heads of d: same width, same linears
    cfg = tiny_config(
        heads, kv_heads, d, layers, ffn=ffn, diff_attention=diff, diff_attn_backend="sdpa", **fields
    )
    model = build_model(cfg, vocab_size=vocab, max_sequence_length=s)
    tokens = torch.randint(0, vocab, (b, s))
    kwargs = {"input_ids": tokens, "position_ids": torch.arange(s)[None].expand(b, s), "attention_mask": None}
    with torch.no_grad():
        _, macs, _ = get_model_profile(model, kwargs=kwargs, print_profile=False, as_string=False, warm_up=0)
    f = forward_flops_per_token(
        num_layers=layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=ffn,
        num_attention_heads=heads if fields else 2 * heads // sub,
        num_query_groups=kv_heads if fields else 2 * kv_heads // sub,
        kv_channels=d,
        seq_length=s,
        vocab_size=vocab,
        diff_attention=diff,
        diff_version=fields.get("diff_version", 1),
        num_noise_heads=fields.get("noise"),
    )
    tokens_n = b * s
    assert 2 * int(macs) == tokens_n * (f.linear + f.logits + 2 * f.attention_core)
