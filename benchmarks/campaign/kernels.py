"""Phase `kernels`: forward+backward time of every DIFF attention backend against the baseline's.

Rows are written as they are timed, cheapest and most needed first: at each length the baseline, the
unfused DIFF paths and DIFF V2, then each fused-kernel tile candidate, checked against float64 just
before its own rows. A candidate whose compilation aborts the process therefore leaves every row before
it (the parent derives the headline figures from them). Checks are keyed by backend and head dim, and
none starts past the deadline.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict

from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import Plan, device_of


def backends_to_time(device: str, head_dim: int, dtype) -> tuple[dict[str, Callable], dict[str, tuple]]:
    """(unfused DIFF backends by row name, {row name: (label, tile config, fn)} of the fused kernel's
    tile candidates: the default tiles first; none where Triton cannot run)."""
    from benchmarks import attention as bench

    unfused = bench.make_backends(sweep=False, device=device, head_dim=head_dim)
    fused = {}
    if unfused.pop(bench.TRITON, None) is not None:
        for label, cfg in bench.triton_candidates(head_dim, dtype).items():
            fused[f"{bench.TRITON} {label}"] = (label, cfg, bench.triton_with(cfg))
    return unfused, fused


def phase_kernels(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import attention as bench

    device = device_of(a)
    dtype = bench.DTYPES[plan.attn_dtype]
    torch.manual_seed(0)
    d = plan.attn_head_dim
    unfused, fused = backends_to_time(device, d, dtype)
    checks: dict[tuple[str, int], dict] = {}

    def check(name: str, fn: Callable, head_dim: int) -> dict | None:
        """The backend's float64 check at this head dim, once, and only before the deadline. At the timed
        rows' Triton specialisations (MHA, lengths a multiple of 16, batch 1), so each tile candidate
        compiles once; ragged lengths, GQA and decode are the tests phase's (test_gpu_kernels)."""
        if (name, head_dim) not in checks and time.monotonic() < deadline:
            checks[name, head_dim] = bench.check_backend(
                fn, device, dtype, head_dim, heads=4, kv_heads=4, seq=plan.check_seq
            )
            print(f"check {name} d={head_dim}: {checks[name, head_dim]}", flush=True)
        return checks.get((name, head_dim))

    def keep(rows: list[dict]) -> float | None:
        """Write the rows with their check's verdict; the baseline's TFLOP/s among them, if any."""
        base = None
        for row in rows:
            verdict = checks.get((row["impl"], row["head_dim"]))
            row["correct"] = None if row["impl"] == bench.BASELINE else (verdict or {}).get("correct")
            if row["impl"] == bench.BASELINE:
                base = row["tflops"]
            part.add("attention", row)
        return base

    timing = {"dtype": dtype, "device": device, "warmup": plan.attn_warmup, "iters": plan.attn_iters,
              "deadline": deadline, "log": lambda line: print(line, flush=True)}  # fmt: skip
    layout = {"heads": plan.attn_heads, "kv_heads": plan.attn_kv_heads, "head_dim": d}
    print(bench.format_header(device), flush=True)
    for name, fn in unfused.items():
        check(name, fn, d)
    for s in plan.attn_seqs:  # 4096 first: the headline figures survive a short budget
        base = keep(bench.run_rows([s], backends=unfused, reference_max_seq=plan.attn_reference_max_seq,
                                   **layout, **timing))  # fmt: skip
        for name, (label, cfg, fn) in fused.items():
            if (name, d) not in checks and check(name, fn, d) is not None:
                part.add("triton_candidates", {"label": label, "config": asdict(cfg), **checks[name, d]})
            keep(bench.run_rows([s], backends={name: fn}, baselines=False, baseline_tflops=base,
                                **layout, **timing))  # fmt: skip
    for heads, kv_heads, hd, seqs in plan.attn_extra:  # other head dims: the default tiles vs SDPA
        extra = {bench.SDPA_SPLIT_V: unfused[bench.SDPA_SPLIT_V]}
        if device == "cuda" and bench.triton_available():
            extra[bench.TRITON] = bench.diff_attention_triton
        for name, fn in extra.items():
            check(name, fn, hd)
        keep(
            bench.run_rows(list(seqs), heads=heads, kv_heads=kv_heads, head_dim=hd, backends=extra, **timing)
        )
    if any(r["error"] == "skipped: time budget" for r in part.data.get("attention", [])):
        part.set(_status="partial", _error="some rows skipped: time budget")
