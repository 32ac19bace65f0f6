"""Compiled kernels on a CUDA GPU against float64 math: the fused Triton kernel and the SDPA backend.

Real head sizes (d = 128 for the 3B layout, 96 for 830M, 64), GQA, ragged lengths that leave partial
tiles, and decode-style calls with fewer queries than keys (queries aligned to the end of the keys).
Errors are max|x - ref| / max|ref| per tensor (the output and five gradients) against float64 from the
same rounded inputs; lambda's gradient, one sum of millions of products of either sign, is measured
against sum(|dO| |A2 V|) (`lambda_grad_scale`): relative to the cancelled sum itself, torch's own path
scattered from 1.8e-4 to 1.5e-3 between draws on an H100 while A2 V was as accurate as the fused kernel's
(benchmarks/results/lambda-grad-precision-*.jsonl). Bound for bf16/fp16: no more than twice the error
of torch's own unfused path in the same dtype (SDPA, flash/cuDNN kernels) plus 1e-3, the FlashAttention
test rule; fp32 inputs ("ieee" dots): 1e-4. Skipped without CUDA (`pytest -m gpu` on a GPU; the
campaign's tests phase, whose kernels phase also checks every tile candidate it times against float64).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

NAMES = ("out", "q1", "q2", "k1", "k2", "v", "lam")


@pytest.fixture(autouse=True)
def compiled_triton(monkeypatch):
    """Compiled kernels, not the interpreter (another test module may have set TRITON_INTERPRET)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield


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
    pytest.param(2, 12, 12, 2048, 2048, 128, id="3b-heads-d128-s2048"),
    pytest.param(1, 12, 4, 1000, 1000, 128, id="gqa3-d128-ragged1000"),
    pytest.param(1, 8, 8, 777, 777, 96, id="830m-d96-ragged777"),
    pytest.param(2, 8, 2, 1000, 1000, 64, id="gqa4-d64-ragged1000"),
    pytest.param(1, 12, 12, 1, 4096, 128, id="decode-sq1-sk4096"),
    pytest.param(1, 4, 1, 7, 2053, 128, id="decode-sq7-sk2053-gqa4"),
]


@pytest.mark.parametrize(
    "b,h,g,sq,sk,d,dtype",
    [pytest.param(*c.values, torch.bfloat16, id=f"{c.id}-bf16") for c in CASES]
    + [pytest.param(*c.values, torch.float16, id=f"{c.id}-fp16") for c in CASES[1:3]],
)
def test_triton_within_twice_torch_error(b, h, g, sq, sk, d, dtype):
    from diffmeg.kernels.triton_diff import diff_attention_triton

    mine, theirs = _errors(diff_attention_triton, b, h, g, sq, sk, d, dtype)
    for name, e_mine, e_base in zip(NAMES, mine, theirs, strict=True):
        assert e_mine <= 2 * e_base + 1e-3, f"{name}: triton {e_mine:.2e} vs torch {e_base:.2e}"


@pytest.mark.parametrize("d", [128, 96])
def test_triton_fp32_inputs_close_to_float64(d):
    from diffmeg.kernels.triton_diff import diff_attention_triton

    mine, _ = _errors(diff_attention_triton, 1, 4, 2, 333, 333, d, torch.float32)
    assert max(mine) <= 1e-4, dict(zip(NAMES, mine, strict=True))


@pytest.mark.parametrize("split_v", [False, True], ids=["two-call", "split-v"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sdpa_backend_bf16_close_to_float64(split_v, dtype):
    """SDPA's flash/cuDNN kernels in half precision: errors of a few half-ulps (bf16 half-ulp 3.9e-3)."""
    from diffmeg.kernels.sdpa import diff_attention_sdpa

    mine, _ = _errors(diff_attention_sdpa, 1, 12, 4, 1000, 1000, 128, dtype, split_v=split_v)
    assert max(mine) <= 2e-2, dict(zip(NAMES, mine, strict=True))


@pytest.mark.parametrize("name", ["sdpa_two_call", "sdpa_split_v", "sdpa_split_v_batched", "flex"])
@pytest.mark.parametrize("case", [CASES[1].values, CASES[5].values], ids=["gqa3-ragged1000", "decode-gqa4"])
def test_every_registered_candidate_within_twice_torch_error(name, case):
    """The per-length table's candidates and FlexAttention (gradients: here only, no CPU backward), bf16."""
    from diffmeg import registry

    fn = registry.select("diff_attention", name, "cuda").load()
    mine, theirs = _errors(fn, *case, torch.bfloat16)
    for label, e_mine, e_base in zip(NAMES, mine, theirs, strict=True):
        assert e_mine <= 2 * e_base + 1e-3, f"{name} {label}: {e_mine:.2e} vs torch {e_base:.2e}"


def test_triton_refuses_interpreter_with_cuda_tensors(monkeypatch):
    from diffmeg.errors import DiffmegError
    from diffmeg.kernels.triton_diff import diff_attention_triton

    ts, lam, _ = _inputs(1, 2, 2, 16, 16, 16, torch.float16, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(DiffmegError, match="CPU tensors only"):
        diff_attention_triton(*ts, lam, scale=0.25)
    assert os.environ["TRITON_INTERPRET"] == "1"
