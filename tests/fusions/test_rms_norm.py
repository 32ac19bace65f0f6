"""RMSNorm (diffmeg.fusions.rms_norm): the blocks' norm and DIFF's head norm against the float64 equation,
and the TP tags the layers rely on."""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType

from diffmeg.fusions.rms_norm import HeadRMSNorm, RMSNorm, rms_norm
from tests.builders import make_config


def test_rms_norm_is_the_equation_and_computes_in_fp32():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 16, generator=gen, dtype=torch.float64)
    w = torch.rand(16, generator=gen, dtype=torch.float64) + 0.5
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-5), want, rtol=1e-14, atol=0)
    low = rms_norm(x.bfloat16(), w.bfloat16(), 1e-5)  # fp32 inside, rounded once on the way out
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low, rms_norm(x.bfloat16().float(), w.bfloat16().float(), 1e-5).bfloat16())


def test_block_norm_follows_sequence_parallel_and_head_norm_is_summed_over_tp(single_rank_parallel_state):
    from diffmeg.attention import SUM_GRAD_OVER_TP_ATTR, DiffCoreAttention

    sp = make_config(2, 2, 8, tensor_model_parallel_size=2, sequence_parallel=True)
    assert RMSNorm(sp, 8).weight.sequence_parallel
    assert not RMSNorm(make_config(), 8).weight.sequence_parallel
    assert not hasattr(HeadRMSNorm(16, 1e-5).weight, SUM_GRAD_OVER_TP_ATTR)  # the owner decides
    core = DiffCoreAttention(make_config(2, 1, 8), 1, AttnMaskType.causal, "self")
    assert getattr(core.head_norm.weight, SUM_GRAD_OVER_TP_ATTR)


def test_torch_norm_is_the_equation_and_rounds_as_the_eager_norm():
    from diffmeg.fusions.rms_norm import rms_norm_torch

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(16, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    got = rms_norm_torch(x, w, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad(got, (x, w), grad)
    for mine, ref in zip(got_grads, torch.autograd.grad(want, (x, w), grad), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-13)
    low = rms_norm_torch(x.detach().bfloat16(), w.detach().bfloat16(), 1e-5)  # fp32 inside, rounded once
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low, rms_norm(x.detach().bfloat16(), w.detach().bfloat16(), 1e-5))


def test_fused_norm_classes_keep_the_weight_and_its_sequence_parallel_tag(single_rank_parallel_state):
    from diffmeg.fusions.rms_norm import TorchRMSNorm, rms_norm_torch

    sp = make_config(2, 2, 8, tensor_model_parallel_size=2, sequence_parallel=True)
    norm = TorchRMSNorm(sp, 8)
    assert norm.weight.sequence_parallel and norm.norm_fn is rms_norm_torch
    assert list(norm.state_dict()) == ["weight"]  # checkpoints move between implementations
