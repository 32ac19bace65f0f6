"""Time every differential-attention backend against the baseline Transformer's attention.

    python benchmarks/attention.py                                  # GPU: bf16, d=128, seq 2K..16K
    python benchmarks/attention.py --device cpu --seqs 256 512      # CPU smoke run (fp32)

Every row is one causal attention core at equal FLOPs accounting (diffmeg.training.flops, model FLOPs):
  DIFF (h heads, V of 2d):        QK^T of 2h sub-heads of d + A1 V and A2 V at width 2d = 1.5x baseline
  baseline (2h heads of d):        torch SDPA (flash on GPU), the Transformer of the same width
  causal = half the square; fwd+bwd = 3x fwd (MFU convention; FlashAttention papers use 3.5x, i.e. their
  fwd+bwd TFLOP/s are 7/6 of ours for the same time).
`vs base` = TFLOP/s of the row / TFLOP/s of the baseline: 1.00 means DIFF spends its 1.5x FLOPs at the
baseline's efficiency; the time ratio is then exactly 1.5.

A backend that fails (out of memory, a kernel that does not compile, a wrong result) gets a row with its
error and the sweep goes on. The campaign (benchmarks/campaign/kernels.py) calls `run_rows` and
`check_backend` as a library. Prints a table; it is never run as a timed test.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffmeg.kernels.reference import (  # noqa: E402
    diff_attention_reference,
    diff_errors,
    lambda_grad_scale,
)
from diffmeg.kernels.sdpa import diff_attention_sdpa  # noqa: E402
from diffmeg.training.flops import forward_flops_per_token  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BASELINE = "baseline sdpa"
REFERENCE = "diff reference"
SDPA_TWO_CALL = "diff sdpa two-call"
SDPA_SPLIT_V = "diff sdpa split-v"


def core_flops(b: int, h: int, g: int, s: int, d: int, diff: bool) -> float:
    """Forward model FLOPs of one attention core (b sequences of s tokens), from diffmeg's formula."""
    f = forward_flops_per_token(
        num_layers=1,
        hidden_size=2 * h * d,
        ffn_hidden_size=0,
        num_attention_heads=h if diff else 2 * h,
        num_query_groups=g if diff else 2 * g,
        kv_channels=d,
        seq_length=s,
        vocab_size=0,
        diff_attention=diff,
    )
    return f.attention_core * b * s


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


BACK_TO_BACK_CALLS = 20
"""Calls per timing pair on a GPU: a 0.3 ms call timed alone would include its CPU dispatch (the events
wait on the host's launch), so the pair brackets this many calls queued back to back and divides."""


def time_it(
    fn: Callable[[], object], device: str, warmup: int, iters: int, calls: int | None = None
) -> float:
    """Median seconds per call over `iters` timing pairs, each around `calls` back-to-back calls (default
    BACK_TO_BACK_CALLS on a GPU; 1 on a CPU, whose calls run synchronously, dispatch included anyway)."""
    calls = calls or (BACK_TO_BACK_CALLS if device == "cuda" else 1)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
    times.sort()
    return times[len(times) // 2]


def v2_attention_fn() -> Callable | None:
    """DIFF V2's attention core (DESIGN.md, 'DIFF V2'), or None where diffmeg has no V2.

    V2 runs the baseline's own core attention (here torch SDPA, as the local spec's SDPA core does) over
    2H query heads with contiguous GQA groups, then combines head pairs, attn[2i] - gate_i attn[2i+1]
    (`diffmeg.fusions.diff_combine.combine_head_groups`). Inputs: q [b, 2H, s, d], k/v [b, g, s, d],
    gate [b, H, s] (sigmoid(lambda_proj(x))); output [b, H, s, d]. Core FLOPs: twice the baseline
    Transformer's.
    """
    try:
        from diffmeg.fusions.diff_combine import combine_head_groups
    except ImportError:
        return None

    def diff2_attention(q, k, v, gate, *, scale):
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        b, n2, s, d = attn.shape
        flat = attn.permute(2, 0, 1, 3).reshape(s, b, n2 * d)  # [b, 2H, s, d] -> [s, b, 2H * d]
        out = combine_head_groups(flat, gate.permute(2, 0, 1))  # gate [b, H, s] -> [s, b, H]
        return out.view(s, b, n2 // 2, d).permute(1, 2, 0, 3)  # [s, b, H * d] -> [b, H, s, d]

    return diff2_attention


def make_backends() -> dict[str, Callable]:
    """DIFF V1 backends by row name."""
    return {
        REFERENCE: diff_attention_reference,
        SDPA_TWO_CALL: lambda *a, **k: diff_attention_sdpa(*a, split_v=False, **k),
        SDPA_SPLIT_V: lambda *a, **k: diff_attention_sdpa(*a, split_v=True, **k),
    }


def describe_error(exc: BaseException) -> str:
    """One line for a results row: "OOM", or the exception's type and first line."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "OOM"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


@dataclass
class Timing:
    """Median seconds of the forward and of forward+backward; error instead where the call failed."""

    fwd_s: float | None
    fwd_bwd_s: float | None
    error: str | None = None


def bench_one(fn: Callable, inputs: list[torch.Tensor], device: str, warmup: int, iters: int, **kw) -> Timing:
    """Time one backend; any failure (OOM, a kernel's resource or compile errors, ...) becomes its row's
    error so one bad candidate does not end the sweep."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]

    def fwd():
        with torch.no_grad():
            return fn(*leaves, **kw)

    def fwd_bwd():
        out = fn(*leaves, **kw)
        out.backward(grad)
        for t in leaves:
            t.grad = None

    try:
        out = fn(*leaves, **kw)
        grad = torch.randn_like(out)
        del out
        return Timing(time_it(fwd, device, warmup, iters), time_it(fwd_bwd, device, warmup, iters))
    except Exception as exc:  # noqa: BLE001 - every failure is a result here
        return Timing(None, None, describe_error(exc))
    finally:
        for t in leaves:
            t.grad = None
        if device == "cuda":
            torch.cuda.empty_cache()


CHECKED_TENSORS = ("out", "dq1", "dq2", "dk1", "dk2", "dv", "dlambda")
"""What check_backend compares with float64, in its order: the output and the six gradients."""


def check_backend(
    fn: Callable,
    device: str,
    dtype: torch.dtype,
    head_dim: int,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    seq: int = 333,
    seed: int = 0,
) -> dict:
    """Forward and all six gradients against float64 math on a ragged GQA case.

    Correct = within twice the error of torch's own unfused path in the same dtype, plus 1e-3 (the
    FlashAttention test rule, as tests/kernels use). Errors are max|x - ref| / max|ref| per tensor, except
    dlambda's, which is |x - ref| / sum(|dO| |A2 V|) (`lambda_grad_scale`: a cancelling sum's error
    relative to the sum itself is noise). Returns
    {correct, max_rel_err, torch_rel_err, rel_errs, torch_rel_errs, failed, error}: per tensor errors by
    CHECKED_TENSORS name, and the names over the bound.
    """
    gen = torch.Generator().manual_seed(seed)
    q_shape, k_shape = (1, heads, seq, head_dim), (1, kv_heads, seq, head_dim)
    shapes = [q_shape, q_shape, k_shape, k_shape, (1, kv_heads, seq, 2 * head_dim)]
    ts = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(device) for s in shapes]
    lam = torch.tensor(0.8, device=device)
    dout = torch.randn((1, heads, seq, 2 * head_dim), generator=gen, dtype=torch.float64).to(dtype).to(device)
    scale = head_dim**-0.5

    def run(f: Callable, leaves: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
        out = f(*leaves, scale=scale)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    try:
        ref = run(diff_attention_reference, [t.double() for t in (*ts, lam)], dout.double())
        torch_path = diff_attention_sdpa if device == "cuda" else partial(diff_attention_sdpa, split_v=False)
        theirs = run(torch_path, [*ts, lam], dout)
        mine = run(fn, [*ts, lam], dout)
    except Exception as exc:  # noqa: BLE001
        return {"correct": False, "max_rel_err": None, "torch_rel_err": None, "error": describe_error(exc)}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    # dlambda against the scale of its terms, not of its cancelled sum (lambda_grad_scale)
    lam_scale = lambda_grad_scale(ts[1], ts[3], ts[4], dout, scale=scale)  # q2, k2, v
    errs, base = diff_errors(mine, ref, lam_scale), diff_errors(theirs, ref, lam_scale)
    finite = all(math.isfinite(e) for e in errs)
    within = [e <= 2 * b + 1e-3 for e, b in zip(errs, base, strict=True)]
    return {
        "correct": finite and all(within),
        "max_rel_err": max(errs),
        "torch_rel_err": max(base),
        # per tensor: which one failed, and by how much (the maxima alone hide it)
        "rel_errs": dict(zip(CHECKED_TENSORS, errs, strict=True)),
        "torch_rel_errs": dict(zip(CHECKED_TENSORS, base, strict=True)),
        "failed": [n for n, ok in zip(CHECKED_TENSORS, within, strict=True) if not ok],
        "error": None,
    }


def run_rows(
    seqs: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    backends: dict[str, Callable],
    tokens: int | None = None,
    warmup: int = 5,
    iters: int = 20,
    reference_max_seq: int = 4096,
    deadline: float | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """One row per (seq, backend), the baseline first. batch = max(1, tokens // seq), 1 when tokens is
    None. Rows past `deadline` (time.monotonic()) are recorded as skipped, not timed."""
    h, g, d = heads, kv_heads, head_dim
    rows = []
    for s in seqs:
        b = max(1, tokens // s) if tokens else 1
        q1, q2 = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(2))
        k1, k2 = (torch.randn(b, g, s, d, device=device, dtype=dtype) for _ in range(2))
        v = torch.randn(b, g, s, 2 * d, device=device, dtype=dtype)
        lam = torch.tensor(0.8, device=device)
        bq = torch.randn(b, 2 * h, s, d, device=device, dtype=dtype)
        bk, bv = (torch.randn(b, 2 * g, s, d, device=device, dtype=dtype) for _ in range(2))
        diff_f, base_f = core_flops(b, h, g, s, d, True), core_flops(b, h, g, s, d, False)

        def baseline(q, k, vv):
            return F.scaled_dot_product_attention(
                q, k, vv, is_causal=True, scale=d**-0.5, enable_gqa=k.shape[1] != q.shape[1]
            )

        jobs: list[tuple[str, Callable, list[torch.Tensor], float, dict]] = [
            (BASELINE, baseline, [bq, bk, bv], base_f, {})
        ]
        for name, fn in backends.items():
            if name == REFERENCE and s > reference_max_seq:
                continue
            jobs.append((name, fn, [q1, q2, k1, k2, v, lam], diff_f, {"scale": d**-0.5}))
        v2 = v2_attention_fn()
        if v2 is not None:  # DIFF V2: 2H query heads over the baseline's KV groups, one gate per head pair
            gate = torch.rand(b, 2 * h, s, device=device, dtype=dtype)
            v2_in = [torch.randn(b, 4 * h, s, d, device=device, dtype=dtype), bk, bv, gate]
            jobs.append(("diff2", v2, v2_in, 2 * base_f, {"scale": d**-0.5}))
        base_fb = None
        for name, fn, inputs, flops, kw in jobs:
            if deadline is not None and time.monotonic() > deadline:
                timing = Timing(None, None, "skipped: time budget")
            else:
                timing = bench_one(fn, inputs, device, warmup, iters, **kw)
            row = _row(name, s, b, h, g, d, dtype, flops, timing)
            row["sdpa"] = sdpa_chosen(fn, inputs, **kw) if timing.fwd_bwd_s else None
            if name == BASELINE and timing.fwd_bwd_s:
                base_fb = row["tflops"]
            row["vs_baseline"] = row["tflops"] / base_fb if (row["tflops"] and base_fb) else None
            rows.append(row)
            if log is not None:
                log(format_row(row, device))
        del q1, q2, k1, k2, v, bq, bk, bv
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def sdpa_chosen(fn: Callable, inputs: list[torch.Tensor], **kw) -> list[dict] | None:
    """The backend SDPA chose for each query shape in one forward of `fn` with gradients on (the
    training path; step_profile.sdpa_choices), [] where `fn` calls no SDPA; None if the call failed."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.step_profile import sdpa_choices

    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn(*leaves, **kw)
    except Exception:  # noqa: BLE001 - the timed calls ran; a failure here only loses the record
        return None
    return sdpa_choices(prof)


def _row(name: str, s: int, b: int, h: int, g: int, d: int, dtype, flops: float, t: Timing) -> dict:
    ms = lambda x: None if x is None else x * 1e3  # noqa: E731
    bwd = t.fwd_bwd_s - t.fwd_s if (t.fwd_s is not None and t.fwd_bwd_s is not None) else None
    return {
        "impl": name,
        "seq": s,
        "batch": b,
        "heads": h,
        "kv_heads": g,
        "head_dim": d,
        "dtype": str(dtype).replace("torch.", ""),
        "fwd_ms": ms(t.fwd_s),
        "bwd_ms": ms(bwd),
        "fwd_bwd_ms": ms(t.fwd_bwd_s),
        "fwd_tflops": flops / t.fwd_s / 1e12 if t.fwd_s else None,
        "tflops": 3 * flops / t.fwd_bwd_s / 1e12 if t.fwd_bwd_s else None,
        "error": t.error,
    }


def format_header(device: str) -> str:
    unit = "TF/s" if device == "cuda" else "GF/s"
    return (
        f"{'seq':>6} {'batch':>5}  {'backend':44s} {'fwd ms':>9} {unit:>7}  {'fwd+bwd ms':>10} {unit:>7}"
        f" {'vs base':>7}"
    )


def format_row(row: dict, device: str) -> str:
    scale = 1.0 if device == "cuda" else 1e3  # GF/s on CPU
    if row["error"]:
        return f"{row['seq']:6d} {row['batch']:5d}  {row['impl']:44s} {row['error']}"
    return (
        f"{row['seq']:6d} {row['batch']:5d}  {row['impl']:44s} {row['fwd_ms']:9.2f}"
        f" {row['fwd_tflops'] * scale:7.1f}  {row['fwd_bwd_ms']:10.2f} {row['tflops'] * scale:7.1f}"
        f" {row['vs_baseline'] or 0:7.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=12, help="differential heads (baseline: twice as many)")
    p.add_argument("--kv-heads", type=int, default=None, help="differential KV heads (default: --heads)")
    p.add_argument(
        "--tokens", type=int, default=None, help="batch = max(1, tokens // seq); 16384 (GPU), 1024 (CPU)"
    )
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--skip", nargs="*", default=[], help="row names to leave out (e.g. 'diff reference')")
    a = p.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[a.dtype or ("bf16" if device == "cuda" else "fp32")]
    warmup = a.warmup if a.warmup is not None else (5 if device == "cuda" else 1)
    iters = a.iters if a.iters is not None else (20 if device == "cuda" else 3)
    h, g, d = a.heads, a.kv_heads or a.heads, a.head_dim
    torch.manual_seed(0)

    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or 'x86_64'})"
    print(
        f"device: {name}; torch {torch.__version__}; dtype {str(dtype).replace('torch.', '')}; "
        f"threads {torch.get_num_threads()}"
    )
    print(f"DIFF heads {h} (KV {g}), d={d}, V width {2 * d}; baseline heads {2 * h} of d={d}")
    backends = {k: v for k, v in make_backends().items() if k not in a.skip}
    print(format_header(device))
    print("-" * len(format_header(device)))
    run_rows(
        a.seqs,
        heads=h,
        kv_heads=g,
        head_dim=d,
        dtype=dtype,
        device=device,
        backends=backends,
        tokens=a.tokens or (16384 if device == "cuda" else 1024),
        warmup=warmup,
        iters=iters,
        log=print,
    )


if __name__ == "__main__":
    main()
