"""GPU kernels against float64 math: the SDPA backend and its per-length candidates.

The 3B layout's head size (d = 128), GQA, a ragged length, and decode-style calls with fewer queries
than keys (queries aligned to the end of the keys). Errors are max|x - ref| / max|ref| per tensor (the
output and five gradients) against float64 from the same rounded inputs; lambda's gradient, one sum of
millions of products of either sign, is measured against sum(|dO| |A2 V|) (`lambda_grad_scale`):
relative to the cancelled sum itself, torch's own path scattered from 1.8e-4 to 1.5e-3 between draws on
an H100 (benchmarks/results/lambda-grad-precision-*.jsonl). Bound for bf16/fp16: no more than twice the
error of torch's own unfused path in the same dtype (SDPA, flash/cuDNN kernels) plus 1e-3, the
FlashAttention test rule. Skipped without CUDA (`pytest -m gpu` on a GPU; the campaign's tests phase,
whose kernels phase also checks every backend it times against float64).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NAMES = ("out", "q1", "q2", "k1", "k2", "v", "lam")


def _inputs(b, h, g, sq, sk, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = (torch.randn(b, h, sq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k1, k2 = (torch.randn(b, g, sk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, g, sk, 2 * d, generator=gen, dtype=torch.float64)
    ts = [t.to(dtype).cuda() for t in (q1, q2, k1, k2, v)]
    lam = torch.tensor(0.8, dtype=torch.float32, device="cuda")
    dout = torch.randn(b, h, sq, 2 * d, generator=gen, dtype=torch.float64).to(dtype).cuda()
    return ts, lam, dout


def _run(fn, ts, lam, dout, scale, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (*ts, lam)]
    out = fn(*leaves, scale=scale, **kw)
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _errors(fn, b, h, g, sq, sk, d, dtype, seed=0, **kw):
    from diffmeg.kernels.reference import diff_attention_reference, diff_errors, lambda_grad_scale
    from diffmeg.kernels.sdpa import diff_attention_sdpa

    ts, lam, dout = _inputs(b, h, g, sq, sk, d, dtype, seed)
    scale = d**-0.5
    ref = _run(diff_attention_reference, [t.double() for t in ts], lam.double(), dout.double(), scale)
    mine = _run(fn, ts, lam, dout, scale, **kw)
    torch_path = _run(diff_attention_sdpa, ts, lam, dout, scale)
    for name, x in zip(NAMES, mine, strict=True):
        assert x is not None and torch.isfinite(x).all(), f"{name}: missing or not finite"
    # dlambda: against its terms, not its cancelled sum; ts = q1, q2, k1, k2, v
    lam_scale = lambda_grad_scale(ts[1], ts[3], ts[4], dout, scale=scale)
    return diff_errors(mine, ref, lam_scale), diff_errors(torch_path, ref, lam_scale)


CASES = [
    pytest.param(1, 12, 4, 1000, 1000, 128, id="gqa3-ragged1000"),
    pytest.param(1, 4, 1, 7, 2053, 128, id="decode-gqa4"),
]


@pytest.mark.parametrize("split_v", [False, True], ids=["two-call", "split-v"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sdpa_backend_bf16_close_to_float64(split_v, dtype):
    """SDPA's flash/cuDNN kernels in half precision: errors of a few half-ulps (bf16 half-ulp 3.9e-3)."""
    from diffmeg.kernels.sdpa import diff_attention_sdpa

    mine, _ = _errors(diff_attention_sdpa, 1, 12, 4, 1000, 1000, 128, dtype, split_v=split_v)
    assert max(mine) <= 2e-2, dict(zip(NAMES, mine, strict=True))


@pytest.mark.parametrize("name", ["sdpa_two_call", "sdpa_split_v", "sdpa_split_v_batched"])
@pytest.mark.parametrize("case", [c.values for c in CASES], ids=[c.id for c in CASES])
def test_every_registered_candidate_within_twice_torch_error(name, case):
    """The per-length table's candidates, bf16."""
    from diffmeg import registry

    fn = registry.select("diff_attention", name, "cuda").load()
    mine, theirs = _errors(fn, *case, torch.bfloat16)
    for label, e_mine, e_base in zip(NAMES, mine, theirs, strict=True):
        assert e_mine <= 2 * e_base + 1e-3, f"{name} {label}: {e_mine:.2e} vs torch {e_base:.2e}"
