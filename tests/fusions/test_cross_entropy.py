"""The chunked output projection + cross entropy (diffmeg.fusions.cross_entropy) against the float64
equations and against megatron-core's loss over the whole logits: the loss and every gradient, through
whole models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.builders import make_config, make_v2_config, perturbed_model

CHUNKS = [1, 3, 5, 14, 100]  # 2 x 7 = 14 tokens: sizes that do not divide them, all of them, more


def _equations(hidden, weight, labels, grad_loss):
    """loss_t = log sum_v exp(z_tv) - z_t,y_t with z = h W^T; dL/dz = (softmax(z) - onehot(y)) g_t."""
    z = hidden @ weight.T  # [n, V]
    loss = torch.logsumexp(z, dim=-1) - z.gather(1, labels[:, None])[:, 0]
    dz = (torch.softmax(z, dim=-1) - torch.nn.functional.one_hot(labels, z.shape[1])) * grad_loss[:, None]
    return loss, dz @ weight, dz.T @ hidden


@pytest.mark.parametrize("chunk", CHUNKS)
def test_loss_and_gradients_are_the_equations(chunk):
    from diffmeg.fusions.cross_entropy import linear_cross_entropy

    gen = torch.Generator().manual_seed(0)
    s, b, h, vocab = 7, 2, 5, 11
    hidden = torch.randn(s, b, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, h, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    grad_loss = torch.rand(b, s, generator=gen, dtype=torch.float64)  # e.g. a loss mask over a count

    loss = linear_cross_entropy(hidden, weight, labels, chunk)  # [b, s]
    assert loss.shape == (b, s) and loss.dtype == torch.float64
    loss.backward(grad_loss)
    flat = hidden.detach().reshape(s * b, h)  # token t = (i, j) at row i * b + j, as GPTModel's [s, b, H]
    want, d_hidden, d_weight = _equations(
        flat, weight.detach(), labels.T.reshape(-1), grad_loss.T.reshape(-1)
    )
    torch.testing.assert_close(loss, want.view(s, b).T, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(hidden.grad, d_hidden.view(s, b, h), rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(weight.grad, d_weight, rtol=1e-13, atol=1e-14)


def _models(cfg, chunk, tie=False):
    """The float64 model of `cfg` without and with the chunked loss: same weights (same seed); `tie`: the
    output layer is the word embedding (`share_embeddings_and_output_weights`)."""
    out = []
    for size in (None, chunk):
        c = dataclasses.replace(cfg, cross_entropy_chunk_size=size, share_embeddings_and_output_weights=tie)
        model = perturbed_model(c, torch.Generator().manual_seed(5), 0.5)
        assert (model.output_layer.weight is None) == tie
        out.append(model)
    return out


@pytest.mark.parametrize(
    "arch,chunk,tie",
    [("v1", 5, False), ("v2", 3, False), ("transformer", 7, False), ("v1", 4, True)],
)
def test_whole_model_loss_and_every_gradient_equal_the_unchunked_loss(
    single_rank_parallel_state, arch, chunk, tie
):
    """The per-token loss and the masked mean's gradient for every parameter (embeddings, the output layer
    or the tied embedding, lambda, norms) equal the unchunked path's in float64: the model's whole logits
    (megatron-core's output layer) and the cross entropy's equations (megatron-core's own rounds float64
    logits to fp32). Logits without labels are unchanged."""
    cfg = {
        "v1": make_config(4, 2, 8, 2),
        "v2": make_v2_config(4, 2, 8, 2),
        "transformer": make_config(4, 2, 8, 2, diff_attention=False),
    }[arch]
    whole, chunked = _models(cfg, chunk, tie)
    gen = torch.Generator().manual_seed(7)
    b, s = 2, 13  # 26 tokens: no chunk size above divides them
    tokens = torch.randint(0, 64, (b, s), generator=gen)
    labels = torch.randint(0, 64, (b, s), generator=gen)
    mask = (torch.rand(b, s, generator=gen) > 0.3).double()
    positions = torch.arange(s)[None].expand(b, s)
    logits = whole(input_ids=tokens, position_ids=positions, attention_mask=None)  # [b, s, V]
    want = -torch.log_softmax(logits, dim=-1).gather(2, labels[..., None])[..., 0]  # [b, s]
    got = chunked(input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels)
    assert got.shape == (b, s) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    for loss in (want, got):
        ((loss * mask).sum() / mask.sum()).backward()
    with torch.no_grad():
        same = chunked(input_ids=tokens, position_ids=positions, attention_mask=None)
        torch.testing.assert_close(same, logits, rtol=0, atol=0)
    grads = dict(chunked.named_parameters())
    names = [n for n, _ in whole.named_parameters()]
    assert names == list(grads) and any("word_embeddings" in n for n in names)
    assert any("output_layer" in n for n in names) != tie
    for name, p in whole.named_parameters():
        assert p.grad is not None and grads[name].grad is not None, name
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-12, atol=1e-15, msg=name)


def test_bf16_keeps_the_unchunked_dtypes_and_values(single_rank_parallel_state):
    """bf16 weights: logits in bf16, the loss in fp32 (megatron-core's behaviour); the per-token loss is the
    unchunked one and every gradient keeps its dtype and agrees to bf16 rounding at its scale (the output
    weight's sums the chunks' bf16 products in fp32 and rounds once; on this CPU all others come out
    bit-identical)."""
    whole, chunked = (m.bfloat16() for m in _models(make_config(4, 2, 8, 1), 5))
    _assert_same_bf16_loss_and_gradients(whole, chunked, seed=1, seq=11)


def _assert_same_bf16_loss_and_gradients(whole, other, seed: int, seq: int) -> None:
    """`other`'s fp32 per-token loss is `whole`'s to fp32 rounding, and every gradient keeps its dtype and
    agrees to bf16 rounding at its scale."""
    gen = torch.Generator().manual_seed(seed)
    tokens, labels = torch.randint(0, 64, (2, 2, seq), generator=gen)
    positions = torch.arange(seq)[None].expand(2, seq)
    out = []
    for model in (whole, other):
        loss = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels)
        assert loss.dtype == torch.float32 and loss.shape == (2, seq)
        loss.mean().backward()
        out.append(loss)
    torch.testing.assert_close(out[1], out[0], rtol=1e-6, atol=1e-6)
    for (name, a), (_, b) in zip(whole.named_parameters(), other.named_parameters(), strict=True):
        assert a.grad.dtype == b.grad.dtype == a.dtype, name
        scale = a.grad.float().abs().max().item()
        torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=2**-7, atol=2**-8 * scale, msg=name)


def test_bad_chunk_sizes_are_one_line_errors(monkeypatch):
    from diffmeg.errors import DiffmegError
    from diffmeg.training.arguments import resolve_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(DiffmegError, match=r"--cross-entropy-chunk-size must be >= 1 token"):
        resolve_args(["--model", "diff-tiny", "--cross-entropy-chunk-size", "0"])
    one_chunk = ["--seq-length", "64", "--micro-batch-size", "2", "--cross-entropy-chunk-size", "128"]
    notes = resolve_args(["--model", "diff-tiny", *one_chunk]).dropped_flags
    assert any(
        "--cross-entropy-chunk-size 128 saves no memory: a rank's micro-batch has only 128" in n
        for n in notes
    )
    with pytest.raises(DiffmegError, match="cross_entropy_chunk_size must be a number of tokens >= 1"):
        make_config(cross_entropy_chunk_size=-4)
    with pytest.raises(DiffmegError, match="does not combine with megatron-core's fused cross entropy"):
        make_config(cross_entropy_chunk_size=8, cross_entropy_loss_fusion=True)


def test_fused_loss_is_the_unfused_loss_in_bf16(single_rank_parallel_state):
    """megatron-core's native fused cross entropy (`--cross-entropy-loss-fusion`, the `loss` entry `fused`)
    through a whole bf16 model: the per-token loss to fp32 rounding and every gradient as the unfused
    loss's (both hand the output layer bf16 logit gradients)."""
    cfg = make_config(4, 2, 8, 1, bf16=True)
    whole, fused = (
        perturbed_model(
            dataclasses.replace(cfg, cross_entropy_loss_fusion=f), torch.Generator().manual_seed(5), 0.5
        ).bfloat16()
        for f in (False, True)
    )
    _assert_same_bf16_loss_and_gradients(whole, fused, seed=2, seq=9)
    from diffmeg.errors import DiffmegError

    with pytest.raises(DiffmegError, match="native fused cross entropy returns bf16 gradients: use it with"):
        make_config(cross_entropy_loss_fusion=True)


def _check_fused_loss_over_tp2(rank: int, port: int) -> None:
    """One rank of a TP2 pair: this rank's half of bf16 logits through megatron-core's native fused loss
    gives the whole logits' loss (fp32) and this half of their gradient (bf16 rounding of the equation)."""
    import os

    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # the TP arithmetic, not the compiled kernels (tested above)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank
    )
    try:
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy as fused

        gen = torch.Generator().manual_seed(3)
        s, b, vocab = 5, 2, 12
        logits = (3 * torch.randn(s, b, vocab, generator=gen)).bfloat16()
        labels = torch.randint(0, vocab, (s, b), generator=gen)  # targets on both ranks' halves
        grad_loss = torch.rand(s, b, generator=gen)
        half = logits[..., rank * vocab // 2 : (rank + 1) * vocab // 2].clone().requires_grad_()
        loss = fused(half, labels, torch.distributed.group.WORLD)
        loss.backward(grad_loss)
        z = logits.float()
        want = torch.logsumexp(z, dim=-1) - z.gather(2, labels[..., None])[..., 0]
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        dz = (torch.softmax(z, -1) - torch.nn.functional.one_hot(labels, vocab)) * grad_loss[..., None]
        mine = dz[..., rank * vocab // 2 : (rank + 1) * vocab // 2].bfloat16()
        assert half.grad.dtype == torch.bfloat16
        torch.testing.assert_close(half.grad, mine, rtol=2**-7, atol=1e-3)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_fused_loss_is_vocab_parallel_over_tp2():
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    torch.set_num_threads(1)
    mp.spawn(_check_fused_loss_over_tp2, args=(free_port(),), nprocs=2)
