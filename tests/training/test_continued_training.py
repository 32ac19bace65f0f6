"""Continued training at a longer context: a 4K-style checkpoint resumed at a new length and RoPE base."""

from __future__ import annotations

import torch

from tests.distributed.runner import read_losses, run_training
from tests.reference_model import rope


def _query_before_and_after_rope(model, tokens):
    """Capture layer 0's query sub-heads from the fused QKV output (pre-RoPE) and at the core (post-RoPE)."""
    seen = {}
    attn = model.decoder.layers[0].self_attention
    attn.linear_qkv.register_forward_hook(lambda m, i, o: seen.__setitem__("qkv", o[0].detach()))
    attn.core_attention.register_forward_pre_hook(lambda m, a: seen.__setitem__("q", a[0].detach()))
    model(input_ids=tokens, position_ids=torch.arange(tokens.shape[1])[None], attention_mask=None)
    s, b, _ = seen["qkv"].shape
    groups, d = attn.config.num_query_groups, attn.config.kv_channels
    per_group = attn.config.num_attention_heads // groups
    # fused rows per query sub-group: [per_group query sub-heads, key, value]
    q_pre = seen["qkv"].view(s, b, groups, per_group + 2, d)[:, :, :, :per_group].reshape(s, b, -1, d)
    return q_pre, seen["q"]


def test_longer_context_and_new_rotary_base(tmp_path, single_rank_parallel_state):
    short = str(tmp_path / "seq64")
    run_training(tmp_path, "short", ["--train-iters", "3", "--seq-length", "64", "--save", short])
    long = str(tmp_path / "seq128")
    # --lr-decay-iters: one schedule for its first 3 iterations and, requeued, its 4
    continued = ["--seq-length", "128", "--rotary-base", "640000", "--lr", "8e-5", "--min-lr", "8e-5",
                 "--lr-decay-iters", "4",
                 "--pretrained-checkpoint", short, "--load", long, "--save", long]  # fmt: skip
    proc = run_training(tmp_path, "long", ["--train-iters", "3", *continued])
    assert "initialised weights from pretrained checkpoint" in proc.stdout
    losses = read_losses(tmp_path, "long")
    assert sorted(losses) == [1, 2, 3] and all(v == v and v < 10 for v in losses.values())

    from diffmeg.checkpoints import load_model_weights

    for root, base, other in ((long, 640000.0, 10000.0), (short, 10000.0, 640000.0)):
        model, args = load_model_weights(root)
        assert args.rotary_base == base
        tokens = torch.randint(0, 512, (1, args.seq_length), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            q_pre, q_post = _query_before_and_after_rope(model, tokens)
        expected = rope(q_pre[:, 0].double(), base).float()  # [s, sub-heads, d]
        torch.testing.assert_close(q_post[:, 0], expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(q_post[:, 0], rope(q_pre[:, 0].double(), other).float(), atol=1e-3)

    # A requeued job finds its own checkpoint in --load and resumes it (the pretrained one is ignored).
    proc = run_training(tmp_path, "long", ["--train-iters", "4", *continued])
    assert "loaded checkpoint from" in proc.stdout and "at iteration 3" in proc.stdout
