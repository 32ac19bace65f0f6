"""Phase `kernels`: forward+backward time of every DIFF attention backend against the baseline's."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from benchmarks.campaign.figures import best_triton, fused_speedup
from benchmarks.campaign.part import Part
from benchmarks.campaign.plan import Plan, device_of


def phase_kernels(a: argparse.Namespace, part: Part, deadline: float, plan: Plan) -> None:
    import torch

    from benchmarks import attention as bench

    device = device_of(a)
    dtype = bench.DTYPES[plan.attn_dtype]
    torch.manual_seed(0)
    backends = bench.make_backends(sweep=False, device=device, head_dim=plan.attn_head_dim)
    candidates = {}
    if bench.TRITON in backends:  # one row per tile candidate; the default tiles come first
        del backends[bench.TRITON]
        candidates = bench.triton_candidates(plan.attn_head_dim)
        for label, cfg in candidates.items():
            backends[f"{bench.TRITON} {label}"] = bench.triton_with(cfg)

    def check(fn, head_dim: int) -> dict:
        # At the timed rows' Triton specialisations (MHA, lengths a multiple of 16, batch 1), so each tile
        # candidate compiles once; ragged lengths, GQA and decode are the tests phase's (test_gpu_kernels).
        return bench.check_backend(fn, device, dtype, head_dim, heads=4, kv_heads=4, seq=plan.check_seq)

    # Correctness first (float64 reference): a fast wrong kernel is not a result.
    checks = {}
    for name, fn in backends.items():
        if time.monotonic() > deadline:
            break
        checks[name] = check(fn, plan.attn_head_dim)
        print(f"check {name}: {checks[name]}", flush=True)
        label = name[len(bench.TRITON) + 1 :] if name.startswith(bench.TRITON + " ") else None
        if label is not None:
            part.add(
                "triton_candidates", {"label": label, "config": asdict(candidates[label]), **checks[name]}
            )
    print(bench.format_header(device), flush=True)

    def keep(row: dict) -> None:
        row["correct"] = checks.get(row["impl"], {}).get("correct") if row["impl"] != bench.BASELINE else None
        part.add("attention", row)

    def log_and_keep(line: str) -> None:
        print(line, flush=True)

    timing = {  # every run_rows call below times the same way
        "dtype": dtype,
        "device": device,
        "warmup": plan.attn_warmup,
        "iters": plan.attn_iters,
        "deadline": deadline,
        "log": log_and_keep,
    }
    for s in plan.attn_seqs:
        rows = bench.run_rows(
            [s],
            heads=plan.attn_heads,
            kv_heads=plan.attn_kv_heads,
            head_dim=plan.attn_head_dim,
            backends=backends,
            reference_max_seq=plan.attn_reference_max_seq,
            **timing,
        )
        for row in rows:
            keep(row)
    rows = part.data.get("attention", [])
    best = best_triton(rows, 4096, plan.attn_head_dim)
    if best is not None:
        label = best["impl"][len(bench.TRITON) + 1 :]
        part.set(
            triton_best={"label": label, "head_dim": plan.attn_head_dim, "config": asdict(candidates[label])}
        )
    part.set(fused_speedup_vs_best_unfused_4k=fused_speedup(rows, 4096, plan.attn_head_dim))
    for heads, kv_heads, d, seqs in plan.attn_extra:  # other head dims: the default tiles vs SDPA
        extra = {bench.SDPA_SPLIT_V: bench.make_backends(False, device)[bench.SDPA_SPLIT_V]}
        if device == "cuda" and bench.triton_available():
            extra[bench.TRITON] = bench.diff_attention_triton
            checks[bench.TRITON] = check(bench.diff_attention_triton, d)
        for row in bench.run_rows(
            list(seqs), heads=heads, kv_heads=kv_heads, head_dim=d, backends=extra, **timing
        ):
            keep(row)
    if any(r["error"] == "skipped: time budget" for r in part.data.get("attention", [])):
        part.set(_status="partial", _error="some rows skipped: time budget")
