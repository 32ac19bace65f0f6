"""The SDPA backend against the float64 definition, and its `o1 - lam * o2` combination in fp32."""

from __future__ import annotations

import pytest
import torch

from diffmeg.kernels.reference import diff_attention_reference
from diffmeg.kernels.sdpa import diff_attention_sdpa


def _inputs(dtype: torch.dtype, b=1, h=4, g=2, s=40, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = (torch.randn(b, h, s, d, generator=gen).to(dtype) for _ in range(2))
    k1, k2 = (torch.randn(b, g, s, d, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(b, g, s, 2 * d, generator=gen).to(dtype)
    return [q1, q2, k1, k2, v]


@pytest.mark.parametrize("split_v", [False, True])
def test_matches_float64_reference_with_gradients(split_v):
    ts = _inputs(torch.float64)
    lam = torch.tensor(0.3, dtype=torch.float64)
    mine = [t.clone().requires_grad_(True) for t in (*ts, lam)]
    ref_in = [t.clone().requires_grad_(True) for t in (*ts, lam)]
    out = diff_attention_sdpa(*mine, scale=0.25, split_v=split_v)
    ref = diff_attention_reference(*ref_in, scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(dout)
    ref.backward(dout)
    for a, b in zip(mine, ref_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11)


def test_bf16_combination_keeps_lambda_and_its_gradient_in_fp32():
    """lambda = 0.8003 is 0.80078125 in bf16: the output and lambda's gradient must use the fp32 value."""
    ts = _inputs(torch.bfloat16, seed=2)
    lam = torch.tensor(0.8003, dtype=torch.float32, requires_grad=True)
    zero = torch.tensor(0.0)
    o1 = diff_attention_sdpa(*ts, zero, scale=0.25, split_v=False)  # exactly A1 V in bf16
    o2 = diff_attention_sdpa(ts[1], ts[0], ts[3], ts[2], ts[4], zero, scale=0.25, split_v=False)  # A2 V
    out = diff_attention_sdpa(*ts, lam, scale=0.25, split_v=False)
    expected = (o1.float() - 0.8003 * o2.float()).to(torch.bfloat16)
    assert torch.equal(out, expected)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out.backward(dout)
    exact = -(dout.double() * o2.double()).sum()
    assert lam.grad.dtype == torch.float32
    assert abs(lam.grad.double() - exact) <= 1e-5 * exact.abs()
