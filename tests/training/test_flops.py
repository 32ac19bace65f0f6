"""FLOP accounting: DIFF's attention core is 1.5x the baseline's; everything else is identical."""

from __future__ import annotations

import pytest

from diffmeg.presets import get_preset
from diffmeg.training.flops import forward_flops_per_token

SIZES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "vocab_size")


def _flops(name: str, seq: int):
    """Per-token forward FLOPs of preset `name` at sequence length `seq`."""
    p = get_preset(name)
    return forward_flops_per_token(
        **{k: p[k] for k in SIZES},
        num_query_groups=p["num_attention_heads"],  # the presets are MHA
        seq_length=seq,
        diff_attention=p["diff_attention"],
        diff_version=p.get("diff_version", 1),
    )


@pytest.mark.parametrize("seq", [2048, 4096])
def test_diff_core_is_one_and_a_half_times_baseline(seq):
    diff, base = _flops("diff-3b", seq), _flops("transformer-3b", seq)
    assert diff.linear == base.linear and diff.logits == base.logits
    assert diff.attention_core == pytest.approx(1.5 * base.attention_core)


def test_equal_efficiency_throughput_bound_for_3b():
    """At equal MFU DIFF-3B runs at base/diff FLOPs of the baseline's tokens/s: ~0.976 (2K), ~0.956 (4K)."""
    ratio = {s: _flops("transformer-3b", s).total / _flops("diff-3b", s).total for s in (2048, 4096)}
    assert ratio[2048] == pytest.approx(0.976, abs=0.002)
    assert ratio[4096] == pytest.approx(0.956, abs=0.002)


def test_hand_count_tiny():
    sizes = dict(num_layers=1, hidden_size=8, ffn_hidden_size=16, kv_channels=2, vocab_size=10)
    f = forward_flops_per_token(
        **sizes, num_attention_heads=2, num_query_groups=2, seq_length=4, diff_attention=True
    )
    # 4 sub-heads of 2: QKV 2*8*(8 q + 8 k + 8 v)=384, proj 2*8*8=128, mlp 2*3*8*16=768;
    # scores 2*(4/2)*8=32, context 2*(4/2)*(2 heads * 2 maps * V width 4)=64
    assert (f.linear, f.attention_core, f.logits) == (1280, 96, 160)


def test_diff2_counts_and_throughput_bound_for_3b():
    """V2: core 2x the baseline's, Q projection 2x plus lambda_proj; bound 0.892 (2K), 0.861 (4K)."""
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import resolve_args
    from diffmeg.training.flops import train_flops_per_iteration

    def flops(preset: str, seq: int) -> float:
        return train_flops_per_iteration(
            RunConfig.from_args(resolve_args(["--model", preset, "--seq-length", str(seq)]))
        )

    for seq in (2048, 4096):
        v2 = _flops("diff2-3b", seq)
        base = _flops("transformer-3b", seq)
        assert v2.attention_core == pytest.approx(2 * base.attention_core)
        h, d, H, layers = 24, 128, 3072, 28
        assert v2.linear - base.linear == pytest.approx(layers * (2 * H * h * d + 2 * H * h))
    ratio = {s: flops("transformer-3b", s) / flops("diff2-3b", s) for s in (2048, 4096)}
    assert ratio[2048] == pytest.approx(0.892, abs=0.001)
    assert ratio[4096] == pytest.approx(0.861, abs=0.001)


def test_full_square_counts_twice_the_causal_core_and_nothing_else():
    """Megatron-LM's convention (full square): the core doubles, linears and logits stay."""
    sizes = dict(num_layers=1, hidden_size=8, ffn_hidden_size=16, kv_channels=2, vocab_size=10)
    kw = dict(**sizes, num_attention_heads=2, num_query_groups=2, seq_length=4, diff_attention=True)
    causal, full = forward_flops_per_token(**kw), forward_flops_per_token(**kw, causal=False)
    assert (full.linear, full.attention_core, full.logits) == (1280, 192, 160)
    assert causal.attention_core == 96


def test_train_flops_full_square_for_3b_at_4k():
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import resolve_args
    from diffmeg.training.flops import train_flops_per_iteration

    args = resolve_args(["--model", "transformer-3b", "--seq-length", "4096"])
    run = RunConfig.from_args(args)
    causal, full = train_flops_per_iteration(run), train_flops_per_iteration(run, causal=False)
    core = 3 * _flops("transformer-3b", 4096).attention_core * args.global_batch_size * 4096
    assert full - causal == pytest.approx(core)
