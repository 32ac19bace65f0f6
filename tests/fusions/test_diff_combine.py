"""DIFF's combination step (diffmeg.fusions.diff_combine): V1's `o1 - lam * o2`, whose entry point keeps o2 as
it came, against its eager twin; V2's head groups against the definition; both with fewer noise heads than
signal heads (grouped differential attention)."""

from __future__ import annotations

import pytest
import torch

from diffmeg.fusions.diff_combine import DiffCombine, combine_head_groups, diff_combine, diff_combine_eager


def _maps(dtype: torch.dtype, noise: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """o1 of 6 signal heads, o2 of `noise` heads (6: the 1:1 DIFF), lambda."""
    gen = torch.Generator().manual_seed(0)
    b, h, s, d2 = 2, 6, 5, 8
    o1 = torch.randn(b, h, s, d2, generator=gen).to(dtype).requires_grad_()
    o2 = torch.randn(b, noise, s, d2, generator=gen).to(dtype).requires_grad_()
    lam = torch.tensor(0.37, dtype=torch.float32, requires_grad=True)
    return o1, o2, lam


@pytest.mark.parametrize("noise", [6, 3, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_diff_combine_equals_its_eager_twin_in_values_and_gradients(dtype, noise):
    fused, eager = _maps(dtype, noise), _maps(dtype, noise)
    out, want = diff_combine(*fused), diff_combine_eager(*eager)
    assert out.dtype == dtype
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad)
    want.backward(grad)
    for got, ref, name in zip(fused, eager, ("o1", "o2", "lambda"), strict=True):
        assert got.grad.dtype == ref.grad.dtype, name
        torch.testing.assert_close(got.grad, ref.grad, msg=name)


@pytest.mark.parametrize("noise", [6, 3, 2])
def test_diff_combine_is_the_equation_in_float64(noise):
    """Signal head j subtracts noise head j // (h / n); a noise head's gradient sums over its signal heads."""
    o1, o2, lam = _maps(torch.float64, noise)
    r = 6 // noise
    out = diff_combine(o1, o2, lam)
    want = torch.stack([o1[:, j] - lam.double() * o2[:, j // r] for j in range(6)], dim=1)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-15)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out.backward(grad)
    want_o2 = torch.stack([-lam.double() * grad[:, m * r : (m + 1) * r].sum(1) for m in range(noise)], dim=1)
    torch.testing.assert_close(o2.grad, want_o2, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(o1.grad, grad, rtol=0, atol=0)
    dlam = -sum((grad[:, j] * o2[:, j // r]).sum() for j in range(6))
    torch.testing.assert_close(lam.grad.double(), dlam.detach(), rtol=1e-6, atol=0)


def test_diff_combine_saves_o2_in_its_own_dtype():
    """The point of the Function over its eager twin: no fp32 copy of a bf16 o2 is kept for backward."""
    o1, o2, lam = _maps(torch.bfloat16)
    out = DiffCombine.apply(o1, o2, lam)
    saved = [t.dtype for t in out.grad_fn.saved_tensors]
    assert saved == [torch.bfloat16, torch.float32]  # o2 as it came, lambda


def test_combine_head_groups_with_pairs_is_the_definition():
    gen = torch.Generator().manual_seed(0)
    s, b, n, d = 5, 2, 3, 4
    attn = torch.randn(s, b, 2 * n * d, generator=gen, dtype=torch.bfloat16)
    lam = torch.rand(s, b, n, generator=gen)
    out = combine_head_groups(attn, lam)
    a = attn.float().view(s, b, 2 * n, d)
    want = torch.cat([a[:, :, 2 * i] - lam[:, :, i : i + 1] * a[:, :, 2 * i + 1] for i in range(n)], dim=-1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("ratio", [2, 4])
def test_combine_head_groups_is_the_definition_for_grouped_heads(ratio):
    """Groups `[signal x r, noise]`: signal head j = g r + i outputs attn[g (r + 1) + i] - lam_j times
    attn[g (r + 1) + r], its group's noise head."""
    gen = torch.Generator().manual_seed(1)
    s, b, n, d = 5, 2, 2, 4
    h = n * ratio
    attn = torch.randn(s, b, (h + n) * d, generator=gen, dtype=torch.float64)
    lam = torch.rand(s, b, h, generator=gen, dtype=torch.float64)
    out = combine_head_groups(attn, lam, ratio)
    a = attn.view(s, b, h + n, d)
    noise = [a[:, :, g * (ratio + 1) + ratio] for g in range(n)]  # [s, b, d] each
    want = [
        a[:, :, g * (ratio + 1) + i] - lam[:, :, g * ratio + i : g * ratio + i + 1] * noise[g]
        for g in range(n)
        for i in range(ratio)
    ]
    torch.testing.assert_close(out, torch.cat(want, dim=-1), rtol=0, atol=1e-15)


def _epilogue_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    out = torch.randn(2, 3, 5, 8, generator=gen, dtype=dtype, requires_grad=True)  # [b, h, sq, 2d]
    weight = (1 + 0.3 * torch.randn(8, generator=gen, dtype=dtype)).requires_grad_()
    return out, weight


def test_diff_epilogue_is_the_equation_in_float64():
    from diffmeg.fusions.diff_combine import diff_epilogue

    out, weight = _epilogue_inputs(torch.float64)
    got = diff_epilogue(out, weight, 1e-5, 0.75)
    normed = out / torch.sqrt((out * out).mean(-1, keepdim=True) + 1e-5) * weight * 0.75
    want = torch.stack([normed[:, :, i] for i in range(out.shape[2])])  # [sq, b, h, 2d]
    assert got.is_contiguous() and got.shape == (5, 2, 3, 8)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
