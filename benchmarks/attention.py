"""Time every differential-attention backend against the baseline Transformer's attention.

    python benchmarks/attention.py                                  # GPU: bf16, d=128, seq 2K..16K
    python benchmarks/attention.py --device cpu --seqs 256 512      # CPU smoke run (fp32)
    python benchmarks/attention.py --sweep                          # GPU: also try Triton tile configs

Every row is one causal attention core at equal FLOPs accounting (diffmeg.training.flops, model FLOPs):
  DIFF (h heads, V of 2d):        QK^T of 2h sub-heads of d + A1 V and A2 V at width 2d = 1.5x baseline
  baseline (2h heads of d):        torch SDPA (flash on GPU), the Transformer of the same width
  causal = half the square; fwd+bwd = 3x fwd (MFU convention; FlashAttention papers use 3.5x, i.e. their
  fwd+bwd TFLOP/s are 7/6 of ours for the same time).
`vs base` = TFLOP/s of the row / TFLOP/s of the baseline: 1.00 means DIFF spends its 1.5x FLOPs at the
baseline's efficiency; the time ratio is then exactly 1.5.
Prints a table; it is never run as a timed test.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffmeg.kernels.reference import diff_attention_reference  # noqa: E402
from diffmeg.kernels.sdpa import diff_attention_sdpa  # noqa: E402
from diffmeg.kernels.triton_diff import TritonDiffConfig, diff_attention_triton, triton_available  # noqa: E402
from diffmeg.training.flops import forward_flops_per_token  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def time_it(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _tiles(
    fbm: int, fbn: int, splits: int, fw: int, kbm: int, kbn: int, split_kv: bool, qbm: int, qbn: int, bw: int
):
    label = f"f{fbm}x{fbn}s{splits}w{fw} kv{kbm}x{kbn}{'s' if split_kv else ''} q{qbm}x{qbn} w{bw}"
    return label, TritonDiffConfig(fbm, fbn, splits, fw, 2, kbm, kbn, qbm, qbn, bw, 2, split_kv)


# Candidates from the sm_90 ptxas sweep (docs/benchmarks.md): forward BM, BN, V splits, warps; dK/dV BM,
# BN, split into dV and dK passes; dQ BM, BN; backward warps. The first two are the d=128 and d=64
# defaults; the f64x32s1w8 one spills least but its score tiles have fewer rows than its warps cover.
SWEEP_CONFIGS = dict(
    _tiles(*c)
    for c in [
        (64, 16, 2, 4, 16, 128, False, 128, 16, 8),
        (64, 16, 1, 4, 16, 128, True, 128, 32, 8),
        (128, 32, 2, 8, 16, 128, False, 128, 16, 8),
        (128, 32, 2, 8, 16, 128, True, 128, 32, 8),
        (128, 64, 2, 8, 32, 128, False, 128, 32, 8),
        (64, 32, 1, 8, 16, 32, False, 32, 16, 8),
    ]
)


def make_backends(sweep: bool, device: str) -> dict[str, Callable]:
    backends: dict[str, Callable] = {
        "reference": diff_attention_reference,
        "sdpa two-call": lambda *a, **k: diff_attention_sdpa(*a, split_v=False, **k),
        "sdpa split-V (4 calls)": lambda *a, **k: diff_attention_sdpa(*a, split_v=True, **k),
    }
    if device == "cuda" and triton_available():
        backends["triton fused"] = diff_attention_triton
        if sweep:  # candidates from the sm_90 ptxas spill sweep (docs/benchmarks.md); defaults first
            for label, cfg in SWEEP_CONFIGS.items():
                backends[f"triton {label}"] = lambda *a, _cfg=cfg, **k: diff_attention_triton(
                    *a, config=_cfg, **k
                )
    return backends


def bench_one(fn: Callable, inputs: list[torch.Tensor], device: str, warmup: int, iters: int, **kw):
    """(fwd seconds, fwd+bwd seconds); inf where the backend runs out of memory."""
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
        return time_it(fwd, device, warmup, iters), time_it(fwd_bwd, device, warmup, iters)
    except torch.OutOfMemoryError:
        return math.inf, math.inf
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
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
    p.add_argument("--skip", nargs="*", default=[], help="backend names to leave out (e.g. reference)")
    p.add_argument("--sweep", action="store_true", help="also time candidate Triton tile configs (GPU)")
    a = p.parse_args(argv)
    device = a.device
    dtype = DTYPES[a.dtype or ("bf16" if device == "cuda" else "fp32")]
    warmup = a.warmup if a.warmup is not None else (5 if device == "cuda" else 1)
    iters = a.iters if a.iters is not None else (20 if device == "cuda" else 3)
    h, g, d = a.heads, a.kv_heads or a.heads, a.head_dim
    tokens = a.tokens or (16384 if device == "cuda" else 1024)
    torch.manual_seed(0)

    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or 'x86_64'})"
    threads = torch.get_num_threads()
    print(
        f"device: {name}; torch {torch.__version__}; dtype {str(dtype).replace('torch.', '')}; "
        f"threads {threads}"
    )
    tri = "triton " + __import__("triton").__version__ if triton_available() else "triton n/a"
    print(f"{tri}; DIFF heads {h} (KV {g}), d={d}, V width {2 * d}; baseline heads {2 * h} of d={d}")
    if device != "cuda":
        print(
            "note: no GPU -> the fused Triton kernel is not timed (TRITON_INTERPRET timings are meaningless)"
        )
    backends = {k: v for k, v in make_backends(a.sweep, device).items() if k not in a.skip}

    unit, scale_u = ("TF/s", 1e12) if device == "cuda" else ("GF/s", 1e9)
    header = f"{'seq':>6} {'batch':>5}  {'backend':38s} {'fwd ms':>9} {unit:>7} {'vs base':>7}"
    header += f"  {'fwd+bwd ms':>10} {unit:>7} {'vs base':>7}"
    print(header)
    print("-" * len(header))
    for s in a.seqs:
        b = max(1, tokens // s)
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

        tb_f, tb_fb = bench_one(baseline, [bq, bk, bv], device, warmup, iters)
        rows = [("baseline SDPA (2h heads of d)", tb_f, tb_fb, base_f)]
        for bname, fn in backends.items():
            tf, tfb = bench_one(fn, [q1, q2, k1, k2, v, lam], device, warmup, iters, scale=d**-0.5)
            rows.append((bname, tf, tfb, diff_f))
        base_tf, base_tfb = max(base_f / tb_f, 1e-30), max(3 * base_f / tb_fb, 1e-30)
        for bname, tf, tfb, flops in rows:
            r_f, r_fb = flops / tf, 3 * flops / tfb
            print(
                f"{s:6d} {b:5d}  {bname:38s} {_ms(tf):>9} {r_f / scale_u:7.1f} {r_f / base_tf:7.2f}"
                f"  {_ms(tfb):>10} {r_fb / scale_u:7.1f} {r_fb / base_tfb:7.2f}"
            )
        del q1, q2, k1, k2, v, bq, bk, bv
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("note: TRITON_INTERPRET=1 is set")


def _ms(seconds: float) -> str:
    return "OOM" if math.isinf(seconds) else f"{seconds * 1e3:.2f}"


if __name__ == "__main__":
    main()
