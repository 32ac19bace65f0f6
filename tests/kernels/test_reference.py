"""diffmeg/kernels/reference.py's lambda_grad_scale, written out from its equation in float64."""

from __future__ import annotations

import math

import torch

from diffmeg.kernels.reference import diff_errors, lambda_grad_scale


def test_lambda_grad_scale_is_the_sum_of_absolute_terms_of_dlambda():
    """sum over b, h, i, c of |dO[b,h,i,c]| * |(A2 V)[b,h,i,c]|, A2 = causal softmax(Q2 K2^T * scale),
    GQA heads reading KV head h // (H / G), each element computed by explicit loops."""
    gen = torch.Generator().manual_seed(3)
    b, h, g, s, d = 1, 4, 2, 5, 3
    q2 = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    k2 = torch.randn(b, g, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, g, s, 2 * d, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, h, s, 2 * d, generator=gen, dtype=torch.float64)
    scale = 0.7
    expected, signed = 0.0, 0.0
    for head in range(h):
        kv = head // (h // g)
        for i in range(s):
            dots = [sum(q2[0, head, i, t] * k2[0, kv, j, t] for t in range(d)) for j in range(i + 1)]
            logits = [scale * float(x) for x in dots]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            for c in range(2 * d):
                a2v = sum(weights[j] / total * v[0, kv, j, c] for j in range(i + 1))
                expected += abs(dout[0, head, i, c].item()) * abs(float(a2v))
                signed += dout[0, head, i, c].item() * float(a2v)
    got = lambda_grad_scale(q2, k2, v, dout.float(), scale=scale)
    assert math.isclose(got, expected, rel_tol=1e-6)  # dO rounded to fp32 on the way in
    assert abs(signed) < 0.5 * got  # dlambda = -signed: the terms cancel, even at 120 of them


def test_diff_errors_relative_per_tensor_and_dlambda_against_its_scale():
    ref = [torch.tensor([2.0, -4.0], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)]
    ref.append(torch.tensor(0.01, dtype=torch.float64))  # dlambda: a small, cancelled sum
    xs = [torch.tensor([2.0, -3.0]), torch.tensor([0.5]), torch.tensor(0.02)]
    errs = diff_errors(xs, ref, lam_scale=2.0)
    assert errs[:2] == [0.25, 0.0]  # max|x - ref| / max|ref|
    assert math.isclose(errs[2], 0.01 / 2.0, rel_tol=1e-6)  # not 0.01 / 0.01 = 1
