"""The fused Triton differential attention against the float64 reference: forward and every gradient.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by a module fixture before
any kernel is created, and restored afterwards so no other test module sees it) on CPU tensors, in
float32 and float16 (the interpreter's bf16 `tl.dot` is wrong). With CUDA the same small cases run
compiled on the GPU, and the `gpu`-marked cases check bf16 at real sizes.

Errors are measured as max|x - ref| / max|ref| per tensor (`_rel_err`), ref in float64 from the same
(rounded) inputs, so the bounds below are about the kernel's arithmetic alone:
  float32: products are exact fp32 ("ieee" dot), sums over <= 70 keys, exp2 in fp32 -> observed ~5e-7;
           bound 2e-5 (fp32 eps 1.2e-7 times a few dozen), far below any algorithmic slip (>= 1e-2).
  float16: P (and dS in the backward) is rounded to fp16 (half-ulp 4.9e-4) before its matmul, like
           FlashAttention, and outputs/gradients are rounded to fp16 -> observed <= 7.2e-4 for the
           output and q/k/v gradients. lambda's gradient -sum(dO * O2) sums every position with O2
           saved in fp16, with cancellation -> observed 1.1e-3. Bound 2e-3 (about four half-ulps).
  bfloat16 (GPU only): 8 mantissa bits (half-ulp 3.9e-3): the kernel's error must stay within 2x that
           of torch's own bf16 SDPA path on the same inputs (plus 1e-3), the FlashAttention test rule.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install triton; CPU runs use TRITON_INTERPRET=1)",
        allow_module_level=True,
    )

from diffmeg.errors import DiffmegError  # noqa: E402
from diffmeg.kernels.reference import diff_attention_reference  # noqa: E402
from diffmeg.kernels.triton_diff import (  # noqa: E402
    TritonDiffConfig,
    diff_attention_triton,
    triton_available,
    triton_usable,
)

INTERPRET = not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter_on_cpu():
    """TRITON_INTERPRET=1 for this module only. `triton.jit` reads it when the kernels module is first
    imported; diffmeg.kernels.triton_diff re-imports that module if the setting changed since."""
    old = os.environ.get("TRITON_INTERPRET")
    if INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


NAMES = ("q1", "q2", "k1", "k2", "v", "lam")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def tiles(bm: int, bn: int, v_splits: int = 1, split_dkdv: bool = False, split_dk: bool = False):
    """Small tiles so that 37/70-long sequences leave ragged last blocks in every kernel."""
    return TritonDiffConfig(
        block_m=bm, block_n=bn, v_splits=v_splits, num_warps=4, num_stages=1,
        dkdv_block_m=bm, dkdv_block_n=bn, dq_block_m=bm, dq_block_n=bn, bwd_num_warps=4, bwd_num_stages=1,
        split_dkdv=split_dkdv, split_dk=split_dk,
    )  # fmt: skip


def make_inputs(b, h, g, sq, sk, d, dtype, seed=0, lam=0.8):
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = (torch.randn(b, h, sq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k1, k2 = (torch.randn(b, g, sk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, g, sk, 2 * d, generator=gen, dtype=torch.float64)
    # Round once to the test dtype: reference and kernel then see identical values.
    ts = [t.to(dtype).to(DEVICE) for t in (q1, q2, k1, k2, v)]
    return ts, torch.tensor(lam, dtype=torch.float32, device=DEVICE)


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def run_both(ts, lam, cfg, scale=None, seed=1):
    """(kernel out, kernel grads, reference out in fp64, reference grads in fp64) for one upstream dO."""
    d = ts[0].shape[-1]
    scale = d**-0.5 if scale is None else scale
    mine = [t.clone().requires_grad_(True) for t in (*ts, lam)]
    out = diff_attention_triton(*mine, scale=scale, config=cfg)
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype).to(out.device)
    out.backward(dout)
    ref_in = [t.detach().double().requires_grad_(True) for t in (*ts, lam)]
    ref = diff_attention_reference(*ref_in, scale=scale)
    ref.backward(dout.double())
    return out, [t.grad for t in mine], ref, [t.grad for t in ref_in]


def assert_matches(ts, lam, cfg, dtype, **kw):
    start = time.perf_counter()
    out, grads, ref, ref_grads = run_both(ts, lam, cfg, **kw)
    assert out.dtype == dtype and out.shape == ref.shape
    errs = {"out": _rel_err(out, ref)}
    for name, g, rg in zip(NAMES, grads, ref_grads, strict=True):
        assert g is not None and g.dtype == (torch.float32 if name == "lam" else dtype), name
        assert torch.isfinite(g).all(), name
        errs[name] = _rel_err(g, rg)
    bad = {k: e for k, e in errs.items() if not e <= TOL[dtype]}
    assert not bad, f"errors above {TOL[dtype]:g}: {bad} (all: {errs})"
    print(f"max rel err {max(errs.values()):.2e} ({time.perf_counter() - start:.2f}s)")


# (b, h, g, sq, sk, d, dtype, block_m, block_n, v_splits): MHA and GQA, ragged lengths, decode alignment.
CASES = [
    pytest.param(1, 2, 2, 37, 37, 16, torch.float32, 16, 16, 1, id="mha-d16-ragged37-fp32"),
    pytest.param(1, 4, 2, 70, 70, 32, torch.float32, 32, 16, 2, id="gqa2-d32-ragged70-vsplit-fp32"),
    pytest.param(1, 2, 2, 70, 70, 64, torch.float32, 32, 32, 1, id="mha-d64-ragged70-fp32"),
    pytest.param(1, 4, 1, 37, 70, 64, torch.float32, 16, 32, 1, id="gqa4-d64-sq37-sk70-fp32"),
    pytest.param(1, 2, 1, 5, 70, 32, torch.float32, 16, 16, 2, id="decode-sq5-sk70-fp32"),
    pytest.param(1, 2, 2, 1, 37, 16, torch.float32, 16, 16, 1, id="decode-sq1-sk37-fp32"),
    pytest.param(1, 2, 2, 33, 33, 128, torch.float32, 32, 32, 1, id="mha-d128-fp32"),
    pytest.param(1, 2, 2, 37, 37, 48, torch.float32, 16, 16, 1, id="mha-d48-padded-fp32"),
    pytest.param(1, 2, 2, 70, 70, 64, torch.float16, 32, 32, 1, id="mha-d64-ragged70-fp16"),
    pytest.param(1, 4, 2, 37, 70, 16, torch.float16, 16, 32, 2, id="gqa2-d16-sq37-sk70-fp16"),
    pytest.param(2, 2, 1, 64, 64, 32, torch.float16, 32, 16, 1, id="gqa2-d32-even64-fp16"),
    # d = 96 (DIFF-830M): head dim as 64 + 32 and V as 128 + 64 (or 96 = 64 + 32 per half, 64 per third)
    pytest.param(1, 4, 2, 70, 70, 96, torch.float32, 32, 16, 1, id="gqa2-d96-ragged70-fp32"),
    pytest.param(1, 2, 1, 37, 70, 96, torch.float16, 16, 32, 2, id="gqa2-d96-vsplit2-sq37-sk70-fp16"),
    pytest.param(1, 2, 2, 45, 45, 96, torch.float32, 16, 16, 3, id="mha-d96-vsplit3-fp32"),
    pytest.param(1, 2, 1, 3, 50, 96, torch.float32, 16, 16, 2, id="decode-sq3-sk50-d96-fp32"),
]


@pytest.mark.parametrize("b,h,g,sq,sk,d,dtype,bm,bn,splits", CASES)
def test_forward_and_gradients_match_float64_reference(b, h, g, sq, sk, d, dtype, bm, bn, splits):
    ts, lam = make_inputs(b, h, g, sq, sk, d, dtype, seed=sq * 7 + d)
    assert_matches(ts, lam, tiles(bm, bn, splits), dtype)


@pytest.mark.parametrize("split_dk", [False, True], ids=["dV|dK", "dV|dK1|dK2"])
@pytest.mark.parametrize(
    "h,g,sq,sk,d,dtype", [(4, 2, 37, 70, 32, torch.float32), (2, 1, 70, 70, 64, torch.float16)]
)
def test_dv_and_dk_in_separate_passes(h, g, sq, sk, d, dtype, split_dk):
    """split_dkdv (and split_dk): dV, dK1, dK2 from two (three) launches of the key-block kernel (the d=128
    register budget)."""
    ts, lam = make_inputs(1, h, g, sq, sk, d, dtype, seed=17)
    assert_matches(ts, lam, tiles(16, 32, split_dkdv=True, split_dk=split_dk), dtype)


def test_head_dims_as_one_or_two_exact_tiles():
    from diffmeg.kernels.triton_diff import split_width

    assert split_width(128) == (128, 16, False) and split_width(16) == (16, 16, False)
    assert split_width(96) == (64, 32, True) and split_width(192) == (128, 64, True)
    assert split_width(48) == (32, 16, True)
    assert split_width(112) == (128, 16, False)  # 64 + 48: padded and masked
    assert split_width(8) == (16, 16, False)


def test_v_splits_must_divide_v():
    from diffmeg.kernels.triton_diff import fwd_meta

    with pytest.raises(DiffmegError, match="v_splits must be"):
        fwd_meta(128, 64, torch.float32, tiles(16, 16, v_splits=3), store_o2=False)


@pytest.mark.parametrize("split", [(False, False), (True, False), (True, True)], ids=["one", "two", "three"])
def test_d96_dv_and_dk_passes(split):
    ts, lam = make_inputs(1, 2, 1, 45, 45, 96, torch.float32, seed=29)
    assert_matches(ts, lam, tiles(16, 16, split_dkdv=split[0], split_dk=split[1]), torch.float32)


def test_default_tiles_and_negative_lambda():
    """The default config of this device, a lambda below zero and a non-default softmax scale."""
    ts, lam = make_inputs(1, 2, 1, 45, 45, 32, torch.float32, seed=3, lam=-0.35)
    assert_matches(ts, lam, None, torch.float32, scale=0.3)


def test_strided_views_as_the_core_attention_passes_them():
    """DiffCoreAttention hands over permuted views of megatron's [s, b, 2h, d] q/k/v: no copies needed."""
    s, b, h, g, d = 37, 2, 2, 1, 16
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(s, b, 2 * h, d, generator=gen).to(DEVICE)
    k = torch.randn(s, b, 2 * g, d, generator=gen).to(DEVICE)
    v = torch.randn(s, b, 2 * g, d, generator=gen).to(DEVICE)
    qv = q.view(s, b, h, 2, d).permute(3, 1, 2, 0, 4)  # [2, b, h, s, d]
    kv = k.view(s, b, g, 2, d).permute(3, 1, 2, 0, 4)
    vv = v.reshape(s, b, g, 2 * d).permute(1, 2, 0, 3)  # [b, g, s, 2d]
    assert not qv[0].is_contiguous() and not vv.is_contiguous()
    lam = torch.tensor(0.5, device=DEVICE)
    assert_matches([qv[0], qv[1], kv[0], kv[1], vv], lam, tiles(16, 16), torch.float32)


def test_inference_and_partial_gradients():
    """No-grad forward (O2 not stored) equals the training forward; grads only where asked for."""
    ts, lam = make_inputs(1, 2, 2, 37, 37, 16, torch.float32, seed=5)
    cfg = tiles(16, 16)
    with torch.no_grad():
        out_nograd = diff_attention_triton(*ts, lam, scale=0.25, config=cfg)
    v = ts[4].clone().requires_grad_(True)
    lam_g = lam.clone().requires_grad_(True)
    out = diff_attention_triton(*ts[:4], v, lam_g, scale=0.25, config=cfg)
    torch.testing.assert_close(out.detach(), out_nograd, rtol=0, atol=0)
    out.square().sum().backward()
    ref_v = ts[4].double().requires_grad_(True)
    ref_lam = lam.double().requires_grad_(True)
    ref = diff_attention_reference(*(t.double() for t in ts[:4]), ref_v, ref_lam, scale=0.25)
    ref.square().sum().backward()
    assert _rel_err(v.grad, ref_v.grad) < TOL[torch.float32]
    assert _rel_err(lam_g.grad, ref_lam.grad) < TOL[torch.float32]


def test_contract_errors():
    ts, lam = make_inputs(1, 2, 2, 8, 8, 16, torch.float32)
    with pytest.raises(DiffmegError, match="dropout"):
        diff_attention_triton(*ts, lam, scale=0.25, dropout_p=0.1)
    with pytest.raises(DiffmegError, match="causal-only"):
        diff_attention_triton(*ts, lam, scale=0.25, attention_mask=torch.zeros(8, 8, dtype=torch.bool))
    long_q, _ = make_inputs(1, 2, 2, 9, 8, 16, torch.float32)
    with pytest.raises(DiffmegError, match="sq <= sk"):
        diff_attention_triton(long_q[0], long_q[1], *ts[2:], lam, scale=0.25)
    with pytest.raises(DiffmegError, match="multiple of KV heads"):
        bad, _ = make_inputs(1, 3, 2, 8, 8, 16, torch.float32)
        diff_attention_triton(*bad, lam, scale=0.25)
    with pytest.raises(DiffmegError, match="one dtype"):
        diff_attention_triton(ts[0].double(), *ts[1:], lam, scale=0.25)


def test_triton_available_reflects_interpreter(monkeypatch):
    assert triton_available() and triton_usable(DEVICE)
    if not torch.cuda.is_available():
        assert not triton_usable("cuda")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not triton_available() and not triton_usable("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check")
def test_interpreter_works_when_triton_was_imported_first(tmp_path):
    """megatron-core imports triton before any test can set TRITON_INTERPRET: the kernels must still run."""
    script = (
        "import os, torch, triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from diffmeg.kernels.triton_diff import diff_attention_triton\n"
        "q = torch.randn(1, 2, 20, 16); v = torch.randn(1, 2, 20, 32)\n"
        "out = diff_attention_triton(q, q, q, q, v, torch.tensor(0.5), scale=0.25)\n"
        "print(bool(torch.isfinite(out).all()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("True"), proc.stderr[-3000:]


def test_core_attention_with_triton_backend(single_rank_parallel_state):
    """End to end through DiffCoreAttention once the registry knows 'triton' (skipped until it does)."""
    from megatron.core.transformer.enums import AttnMaskType

    from diffmeg.attention import DiffCoreAttention
    from diffmeg.registry import select
    from tests.builders import make_config

    try:
        select("diff_attention", "triton", DEVICE)
    except DiffmegError as exc:
        pytest.skip(f"backend registry has no 'triton' entry yet: {exc}")
    d, s, b, heads, kv_heads = 16, 37, 2, 2, 1
    cores = {}
    for backend in ("reference", "triton"):
        cfg = make_config(heads, kv_heads, d, attention_backend_diff=backend)
        torch.manual_seed(0)
        cores[backend] = DiffCoreAttention(cfg, 3, AttnMaskType.causal, "self").float().to(DEVICE)
    cores["triton"].load_state_dict(cores["reference"].state_dict())
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(s, b, 2 * heads, d, generator=gen).to(DEVICE)
    k = torch.randn(s, b, 2 * kv_heads, d, generator=gen).to(DEVICE)
    v = torch.randn(s, b, 2 * kv_heads, d, generator=gen).to(DEVICE)
    outs, grads = {}, {}
    for name, core in cores.items():
        ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
        outs[name] = core(*ins, None)
        outs[name].square().sum().backward()
        grads[name] = [t.grad for t in ins] + [p.grad for p in core.parameters()]
    torch.testing.assert_close(outs["triton"], outs["reference"], rtol=1e-4, atol=1e-5)
    for mine, ref in zip(grads["triton"], grads["reference"], strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------
# GPU only: bf16 at real sizes, compiled kernels
# ---------------------------------------------------------------------------------------------------


def _bf16_errors(b, h, g, s, d, seed=0):
    from diffmeg.kernels.sdpa import diff_attention_sdpa

    ts, lam = make_inputs(b, h, g, s, s, d, torch.bfloat16, seed=seed, lam=0.8)
    out, grads, ref, ref_grads = run_both(ts, lam, None)
    # torch's own bf16 path (SDPA split-V, flash/cuDNN kernels) on the same inputs: the yardstick.
    base_in = [t.clone().requires_grad_(True) for t in (*ts, lam)]
    base = diff_attention_sdpa(*base_in, scale=d**-0.5)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(base.shape, generator=gen, dtype=torch.float64).to(base.dtype).to(base.device)
    base.backward(dout)
    mine = [_rel_err(out, ref)] + [_rel_err(x, r) for x, r in zip(grads, ref_grads, strict=True)]
    theirs = [_rel_err(base, ref)] + [_rel_err(t.grad, r) for t, r in zip(base_in, ref_grads, strict=True)]
    return mine, theirs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("b,h,g,s,d", [(2, 8, 8, 2048, 128), (1, 12, 4, 4096, 128), (2, 8, 2, 1000, 64)])
def test_bf16_real_sizes_within_bf16_error_of_torch(b, h, g, s, d):
    mine, theirs = _bf16_errors(b, h, g, s, d)
    for name, e_mine, e_base in zip(("out", *NAMES), mine, theirs, strict=True):
        assert e_mine <= 2 * e_base + 1e-3, f"{name}: triton {e_mine:.2e} vs torch bf16 {e_base:.2e}"
